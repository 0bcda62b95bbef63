"""Bytes of the records the cache holds: per token (MLA latent, DSA index key) and per request
(KDA recurrent + conv state). Latents and index keys are replicated under tensor parallelism;
KDA heads are split.

Latent record (kv_lora_rank R + rope dims Dr elements per token per MLA layer):
  bf16  2 (R + Dr) bytes;  fp8  R + Dr bytes (per-tensor scale);
  nvfp4 R / 2 (FP4 latent) + R / 16 (E4M3 block scales) + Dr (rope dims in FP8).
Index-key record (D = index_head_dim): fp8 D + 4 (one fp32 scale); mxfp4 D / 2 + D / 32.
K3: 24 x 576 = 13,824 B/token (fp8); K3.1 Pro 24 x (576 + 132) = 16,992; nvfp4 + mxfp4
24 x (352 + 68) = 10,080.
"""

from __future__ import annotations

from k3.config import K3Config
from k3.dtypes import INDEX_CACHE_DTYPES, KV_CACHE_DTYPES, torch_dtype

# "fp32" / "fp64": what `auto` means for float32 / float64 test models (k3.dtypes)
_WIDE_LATENTS = {"fp32": 4, "fp64": 8}


def latent_record_bytes(cfg: K3Config, kv_cache_dtype: str) -> int:
    """Bytes per token per MLA layer for the latent [c | k_pe]."""
    r, dr = cfg.kv_lora_rank or 0, cfg.qk_rope_head_dim or 0
    if kv_cache_dtype == "bf16":
        return 2 * (r + dr)
    if kv_cache_dtype in _WIDE_LATENTS:
        return _WIDE_LATENTS[kv_cache_dtype] * (r + dr)
    if kv_cache_dtype == "fp8":
        return r + dr
    if kv_cache_dtype == "nvfp4":
        return r // 2 + r // 16 + dr
    raise ValueError(f"kv cache dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES[1:])}")


def index_record_bytes(cfg: K3Config, index_cache_dtype: str) -> int:
    """Bytes per token per MLA layer for the DSA index key (0 without DSA)."""
    if not cfg.uses_dsa:
        return 0
    d = cfg.index_head_dim
    if index_cache_dtype == "fp8":
        return d + 4
    if index_cache_dtype == "mxfp4":
        return d // 2 + d // 32
    raise ValueError(f"index cache dtype {index_cache_dtype!r}: expected one of {', '.join(INDEX_CACHE_DTYPES)}")


def attention_bytes_per_token(cfg: K3Config, *, kv_cache_dtype: str, index_cache_dtype: str = "fp8") -> int:
    """Attention records one GPU stores per token it holds: every MLA layer's latent and index
    key (replicated under TP, so independent of it; no state, no padding)."""
    per_layer = latent_record_bytes(cfg, kv_cache_dtype) + index_record_bytes(cfg, index_cache_dtype)
    return len(cfg.mla_layer_ids) * per_layer


def kda_state_bytes(cfg: K3Config, *, tensor_parallel_size: int = 1, activation_dtype: str | None = None) -> int:
    """One request's KDA state on one rank: per KDA layer an fp32 [H/tp, K, V] recurrent state
    (float64 for a float64 model) plus the conv window (last W-1 pre-conv q, k, v inputs, in
    the activation dtype, by default the checkpoint's)."""
    return sum(n for _, n in kda_state_region_sizes(cfg, tensor_parallel_size, activation_dtype))


def kda_state_region_sizes(cfg: K3Config, tensor_parallel_size: int,
                           activation_dtype: str | None = None) -> list[tuple[str, int]]:
    """(name, bytes) of each KDA layer's recurrent and conv state on one rank."""
    la = cfg.linear_attn
    if la is None:
        return []
    act = torch_dtype(activation_dtype or cfg.dtype).itemsize
    state = 8 if act == 8 else 4
    heads = la.num_heads // tensor_parallel_size
    out = []
    for layer in cfg.kda_layer_ids:
        out.append((f"layer{layer}.recurrent", heads * la.head_dim * la.head_dim * state))
        out.append((f"layer{layer}.conv", 3 * heads * la.head_dim * (la.short_conv_kernel_size - 1) * act))
    return out
