"""The names of k3's dtypes and cache formats, without torch.

What the command line and a checkpoint's config.json may say: activation dtype names (torch's
own), the cache record formats, and the vLLM spellings k3 accepts for them. `k3.dtypes` maps
these names onto torch dtypes; this module stays importable without torch so that `k3 --help`
and argument errors answer before torch loads.
"""

from __future__ import annotations

# activation dtypes: what `--dtype`, EngineConfig.dtype and config.json "dtype" say
DTYPE_NAMES = ("bfloat16", "float16", "float32", "float64")
# spellings `k3 serve --dtype` also accepts (vLLM's)
DTYPE_ALIASES = {"half": "float16", "float": "float32"}

# Cache record formats keep their CLI spellings (`--kv-cache-dtype`, `--index-cache-dtype`).
# nvfp4 latents: `k3.quant.nvfp4_latent` records; mxfp4 index keys: `k3.quant.mxfp4` per token.
KV_CACHE_DTYPES = ("auto", "bf16", "fp8", "nvfp4")
INDEX_CACHE_DTYPES = ("fp8", "mxfp4")
# vLLM's --kv-cache-dtype spellings of the same formats (k3's fp8 latents are e4m3)
KV_CACHE_DTYPE_ALIASES = {"bfloat16": "bf16", "fp8_e4m3": "fp8"}
