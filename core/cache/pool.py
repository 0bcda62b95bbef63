"""The backing tensor of one rank's cache and the per-layer views kernels read and write.

Rows are `row_bytes` apart in one uint8 tensor; each layer's pages are a strided view into
every row (row id = page id = state index), so moving a block is one row copy and kernels
never see the row format. Fresh rows are poisoned (0xFF bytes: NaN in every float format
used) so reads of unwritten memory show.
"""

from __future__ import annotations

import torch

from k3.config import K3Config
from k3.model.metadata import CacheViews, IndexKeyCacheView, KDAStateView, LatentCacheView

from .plan import RowLayout

_LATENT_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32, "fp64": torch.float64}
_ACT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def _view(backing: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Region [offset, offset + nbytes) of every row as a [num_rows, *shape] tensor of dtype."""
    region = backing[:, offset: offset + nbytes]                       # [rows, nbytes] uint8, row-strided
    return region.view(dtype).view(backing.shape[0], *shape)


class CachePool:
    """One rank's packed cache: the backing tensor and its CacheViews."""

    def __init__(self, cfg: K3Config, layout: RowLayout, num_rows: int, *, activation_dtype: str,
                 kv_cache_dtype: str, index_cache_dtype: str, tensor_parallel_size: int, device=None,
                 backing: torch.Tensor | None = None, kda_state_layout: str = "hkv"):
        if kv_cache_dtype not in _LATENT_DTYPES:
            raise ValueError(f"kv cache dtype {kv_cache_dtype!r} cannot be served by the reference kernels yet "
                             f"(supported: {', '.join(_LATENT_DTYPES)})")
        if index_cache_dtype != "fp8" and cfg.uses_dsa:
            raise ValueError(f"index cache dtype {index_cache_dtype!r} cannot be served by the reference kernels yet")
        self.cfg, self.layout, self.num_rows = cfg, layout, num_rows
        if backing is None:
            backing = torch.full((num_rows, layout.row_bytes), 0xFF, dtype=torch.uint8, device=device)
        if tuple(backing.shape) != (num_rows, layout.row_bytes) or backing.dtype != torch.uint8:
            raise ValueError(f"backing tensor must be uint8 [{num_rows}, {layout.row_bytes}], got "
                             f"{backing.dtype} {tuple(backing.shape)}")
        self.backing, self.kda_state_layout = backing, kda_state_layout
        self.views = self._build_views(_LATENT_DTYPES[kv_cache_dtype], _ACT[activation_dtype], tensor_parallel_size)

    @classmethod
    def on_platform(cls, platform, cfg: K3Config, layout: RowLayout, num_rows: int, **kwargs) -> "CachePool":
        """A pool whose backing tensor the platform allocates (`k3_allocate_cache`) and whose
        KDA state rows use the platform's layout (`k3_kda_state_layout`)."""
        return cls(cfg, layout, num_rows, device=platform.info.device,
                   backing=platform.allocate_cache(num_rows, layout.row_bytes),
                   kda_state_layout=platform.kda_state_layout, **kwargs)

    def _build_views(self, latent_dtype, act_dtype, tp) -> CacheViews:
        cfg, layout, b = self.cfg, self.layout, self.backing
        regions = {r.name: r for r in layout.attention_regions + layout.state_regions}
        block = layout.block_size
        latent, index_keys = [], [] if cfg.uses_dsa else None
        for layer in cfg.mla_layer_ids:
            r = regions[f"layer{layer}.latent"]
            scale = torch.ones((), device=b.device) if latent_dtype == torch.float8_e4m3fn else None
            latent.append(LatentCacheView(pages=_view(b, r.offset, r.nbytes, latent_dtype,
                                                      (block, cfg.mla_latent_size)), scale=scale))
            if cfg.uses_dsa:    # fp8 page: every token's D values, then every token's fp32 scale
                r = regions[f"layer{layer}.index_key"]
                d = cfg.index_head_dim
                values = _view(b, r.offset, block * d, torch.float8_e4m3fn, (block, d))
                scales = _view(b, r.offset + block * d, block * 4, torch.float32, (block,))
                index_keys.append(IndexKeyCacheView(values=values, scales=scales, fmt="fp8"))
        kda = []
        la = cfg.linear_attn
        state_dtype = torch.float64 if act_dtype == torch.float64 else torch.float32
        for layer in cfg.kda_layer_ids:
            heads = la.num_heads // tp
            rec, conv = regions[f"layer{layer}.recurrent"], regions[f"layer{layer}.conv"]
            stored = _view(b, rec.offset, rec.nbytes, state_dtype, (heads, la.head_dim, la.head_dim))
            kda.append(KDAStateView(
                recurrent=stored if self.kda_state_layout == "hkv" else stored.transpose(-1, -2),
                conv=_view(b, conv.offset, conv.nbytes, act_dtype,
                           (3 * heads * la.head_dim, la.short_conv_kernel_size - 1)),
                layout=self.kda_state_layout))
        return CacheViews(kda=kda, latent=latent, index_keys=index_keys)

    def copy_row(self, src: int, dst: int) -> None:
        """Move one block (all layers) in one copy."""
        self.backing[dst].copy_(self.backing[src])


def kernel_page_table(block_table: torch.Tensor, *, block_size: int, kernel_page: int) -> torch.Tensor:
    """Translate a block table of rows [N, R] into kernel page ids [N, R * J], J = block_size /
    kernel_page: page k lives in row k // J at token offset (k % J) * kernel_page.

    Kernels index small fixed pages (e.g. 64 tokens) while a row holds a whole block; this is
    the translation the engine applies before each step, so kernels never see the row format.
    """
    if block_size % kernel_page:
        raise ValueError(f"the kernel page ({kernel_page}) must divide the block size ({block_size})")
    j = block_size // kernel_page
    pages = block_table.long()[..., None] * j + torch.arange(j, device=block_table.device)
    return pages.flatten(-2)


def kernel_page_offsets(view_pages: torch.Tensor, pages: torch.Tensor, *, kernel_page: int) -> torch.Tensor:
    """Element offsets (into the view's storage) of the first token of each kernel page:
    row stride x (k // J) + token stride x kernel_page x (k % J). A kernel adds the token and
    channel offsets within the page. view_pages: a layer's [rows, block, record] view."""
    j = view_pages.shape[1] // kernel_page
    row_stride, token_stride = view_pages.stride(0), view_pages.stride(1)
    return view_pages.storage_offset() + (pages // j) * row_stride + (pages % j) * kernel_page * token_stride
