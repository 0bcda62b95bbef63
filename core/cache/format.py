"""The cache format of one rank: every choice that fixes a row's bytes, made once at start-up.

The activation dtype, the latent and index-key record formats, the tensor-parallel size
(KDA heads are split, latents replicated), the block size, the platform's alignment and its
KDA state layout together decide the row format (`RowLayout`) and the dtype of every view.
They are resolved here ("auto" latents, the default block size) and travel as one frozen
value, so the planner, the pool and a draft model's cache never disagree about them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.config import K3Config
from k3.dtypes import INDEX_CACHE_DTYPES, dtype_name, resolve_kv_cache_dtype, torch_dtype

from .plan import RowLayout, default_block_size, row_layout


@dataclass(frozen=True)
class CacheFormat:
    """How one rank stores its cache (see the module docstring).

    activation_dtype:  the model's dtype (conv windows; the latents under kv_cache_dtype "auto").
    kv_cache_dtype:    latent record format, resolved: "bf16", "fp8", "nvfp4", "fp32", "fp64".
    index_cache_dtype: DSA index-key record format: "fp8" or "mxfp4".
    tensor_parallel_size: ranks the KDA heads are split over.
    block_size:        tokens per row (a power of two).
    alignment:         bytes every region and row is aligned to (the platform's).
    kda_state_layout:  "hkv" (canonical) or "hvk", how state rows store each head.
    fp8_flavour:       the fp8 encoding of "fp8" latents: "e4m3fn" (OCP), or "e4m3fnuz" where the
                       platform's matrix cores take that one (AMD gfx942).
    """

    activation_dtype: torch.dtype
    kv_cache_dtype: str
    index_cache_dtype: str
    tensor_parallel_size: int
    block_size: int
    alignment: int = 256
    kda_state_layout: str = "hkv"
    fp8_flavour: str = "e4m3fn"

    @classmethod
    def build(cls, cfg: K3Config, *, activation_dtype: torch.dtype | None = None, kv_cache_dtype: str = "auto",
              index_cache_dtype: str = "fp8", tensor_parallel_size: int = 1, block_size: int | None = None,
              platform=None) -> "CacheFormat":
        """Resolve the options (None / "auto": the checkpoint's dtype, latents as wide as the
        activations, the smallest block whose attention row holds a state); `platform` gives
        the alignment, KDA state layout and fp8 flavour (default: 256 bytes, "hkv", "e4m3fn")."""
        if index_cache_dtype not in INDEX_CACHE_DTYPES:
            raise ValueError(f"index cache dtype {index_cache_dtype!r}: expected one of "
                             f"{', '.join(INDEX_CACHE_DTYPES)}")
        act = activation_dtype or torch_dtype(cfg.dtype)
        kv = resolve_kv_cache_dtype(kv_cache_dtype, act)
        block = block_size or default_block_size(cfg, tensor_parallel_size=tensor_parallel_size, kv_cache_dtype=kv,
                                                 index_cache_dtype=index_cache_dtype, activation_dtype=dtype_name(act))
        extra = {} if platform is None else {"alignment": platform.cache_alignment,
                                             "kda_state_layout": platform.kda_state_layout,
                                             "fp8_flavour": _fp8_flavour(platform)}
        return cls(activation_dtype=act, kv_cache_dtype=kv, index_cache_dtype=index_cache_dtype,
                   tensor_parallel_size=tensor_parallel_size, block_size=block, **extra)

    @classmethod
    def for_model(cls, model, *, block_size: int | None = None, platform=None, **options) -> "CacheFormat":
        """The format for a built model: its dtype and tensor-parallel size."""
        return cls.build(model.cfg, activation_dtype=model.dtype, tensor_parallel_size=model.parallel.world_size,
                         block_size=block_size, platform=platform, **options)

    def layout(self, cfg: K3Config) -> RowLayout:
        """The row format of `cfg`'s cache in this format."""
        return row_layout(cfg, block_size=self.block_size, tensor_parallel_size=self.tensor_parallel_size,
                          kv_cache_dtype=self.kv_cache_dtype, index_cache_dtype=self.index_cache_dtype,
                          activation_dtype=dtype_name(self.activation_dtype), alignment=self.alignment)

    @property
    def state_dtype(self) -> torch.dtype:
        """KDA recurrent states and records: float32, float64 for a float64 model."""
        return torch.float64 if self.activation_dtype == torch.float64 else torch.float32


def _fp8_flavour(platform) -> str:
    """The fp8 encoding a platform's capabilities name ("e4m3fn" when they name none)."""
    capabilities = getattr(platform, "capabilities", None)
    return getattr(capabilities, "fp8_dtype", None) or "e4m3fn"
