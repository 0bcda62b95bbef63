"""Compute-dtype rule shared by every reference op.

Reference ops compute in the dtype they are given, with one floor: half-precision inputs
(bf16, fp16) are computed in fp32, as every kernel accumulates them. float64 inputs stay
float64, which makes the reference the oracle kernels are checked against.
"""

from __future__ import annotations

import torch

from .dtype_names import DTYPE_ALIASES, DTYPE_NAMES, INDEX_CACHE_DTYPES, KV_CACHE_DTYPES  # noqa: F401 (re-exported)


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any given tensor is float64, else float32."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def upcast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype` (no copy when it already is)."""
    return x if x.dtype == dtype else x.to(dtype)


# ----------------------------------------------------------------------------- names
# The one vocabulary of activation dtypes: what `--dtype`, EngineConfig.dtype and a checkpoint's
# config.json "dtype" say, torch's own names.
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                                  "float64": torch.float64}
assert tuple(DTYPES) == DTYPE_NAMES, "k3.dtype_names.DTYPE_NAMES and DTYPES disagree"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an activation dtype name (or alias)."""
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The vocabulary's name of a torch activation dtype."""
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"{dtype} is not an activation dtype ({', '.join(DTYPES)})")


# Cache record formats keep their CLI spellings (`--kv-cache-dtype`, `--index-cache-dtype`).
# "auto" latents follow the activation dtype; "fp32" / "fp64" are what it means for float32 /
# float64 test models (never typed by users). nvfp4 latents are uint8 records
# (`k3.quant.nvfp4_latent`), so they have no element dtype here.
LATENT_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
                                         "fp32": torch.float32, "fp64": torch.float64}
_AUTO_LATENTS = {torch.bfloat16: "bf16", torch.float16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


def resolve_kv_cache_dtype(kv_cache_dtype: str, activation_dtype: torch.dtype | str) -> str:
    """The latent format `kv_cache_dtype` names for a model in `activation_dtype` ("auto": the
    activation dtype's own width)."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    if isinstance(activation_dtype, str):
        activation_dtype = torch_dtype(activation_dtype)
    return _AUTO_LATENTS[activation_dtype]


LEGACY_ROUNDING_ENV = "K3_LEGACY_ROUNDING"


def legacy_rounding() -> bool:
    """Whether K3_LEGACY_ROUNDING (set and not "0") asks for the variants as they rounded before
    issue 32 (docs/batch-invariance.md, "Rounding points"): the MoE gemv's fp16 group sums and
    unrounded products, the MLA decode's split-relative softmax rounding, verification on the
    expanded MLA form and one-token prompt chunks on the decode paths. For the one device run that
    measures the engine-level figure before and after (bench/bf16_batch_company.py) only."""
    import os

    return os.environ.get(LEGACY_ROUNDING_ENV, "0") not in ("", "0")
