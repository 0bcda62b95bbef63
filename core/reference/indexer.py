"""DSA lightning indexer (DeepSeek-V3.2 design, K3.1 Pro numbers, NoPE): keys, scores, top-k.

K3.1 Pro: 32 index heads x 128, top-2048, no rotary at all. The caller builds, per token,
q = Hadamard(wq_b c_q) [T, 32, 128], k = Hadamard(LayerNorm(wk x)) [S, 128] and
w = weights_proj(x) * 32^-0.5 * 128^-0.5 [T, 32]; keys are cached quantised (fp8 with one fp32
scale per token, or MXFP4) and dequantised for scoring. Then
    I(t, s) = sum_h w[t, h] * ReLU(q[t, h] . k[s]),    causal,    top-k per query
and MLA attends only to the selected positions (`topk_indices` of `mla_prefill` / `mla_decode`).

Index-key cache page (`pack_index_key_page`): all values of the page's tokens, then all their
scales; fp8 record = D + 4 bytes (132 for D = 128), mxfp4 record = D/2 + D/32 (68 for D = 128).
"""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype, upcast
from k3.ops_helpers import allowed_mask, index_query, varlen_spans
from k3.plugin.kernels import QuantizedKeys
from k3.quant.fp8 import fp8_dequantize, fp8_quantize
from k3.quant.mxfp4 import mxfp4_dequantize, mxfp4_quantize

from .hadamard import hadamard_transform

__all__ = [
    "hadamard_transform",
    "index_key_record_bytes",
    "indexer_dequantize_keys",
    "indexer_paged_decode_scores",
    "indexer_quantize_keys",
    "indexer_scores",
    "indexer_topk",
    "pack_index_key_page",
    "unpack_index_key_page",
]

_FMTS = ("fp8", "mxfp4")


def _check_fmt(fmt: str, op: str) -> None:
    if fmt not in _FMTS:
        raise ValueError(f"{op}: fmt must be one of {_FMTS}, got {fmt!r}")


def index_key_record_bytes(head_dim: int, fmt: str) -> int:
    """Bytes per token of a cached index key: fp8 D + 4 (one fp32 scale), mxfp4 D/2 + D/32."""
    _check_fmt(fmt, "index_key_record_bytes")
    if fmt == "fp8":
        return head_dim + 4
    if head_dim % 32:
        raise ValueError(f"index_key_record_bytes: mxfp4 needs head_dim % 32 == 0, got {head_dim}")
    return head_dim // 2 + head_dim // 32


def indexer_quantize_keys(
    k: torch.Tensor, *, fmt: str = "fp8"
) -> QuantizedKeys:
    """Oracle of `IndexerQuantizeKeys`: `k3.quant`'s fp8 codec with one block per token, or its MXFP4 codec."""
    _check_fmt(fmt, "indexer_quantize_keys")
    if k.dim() != 2 or not k.is_floating_point():
        raise ValueError(
            f"indexer_quantize_keys: k must be a float tensor [S, D]; "
            f"got {k.dtype} {tuple(k.shape)}"
        )
    if fmt == "mxfp4":
        return QuantizedKeys(*mxfp4_quantize(k))
    values, scales = fp8_quantize(k, block_size=k.shape[1], dtype=torch.float8_e4m3fn)
    return QuantizedKeys(values, scales.reshape(-1))  # [S, 1] -> [S]


def indexer_dequantize_keys(
    values: torch.Tensor, scales: torch.Tensor, *, fmt: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Oracle of `IndexerDequantizeKeys`: the inverse codec."""
    _check_fmt(fmt, "indexer_dequantize_keys")
    if fmt == "mxfp4":
        return mxfp4_dequantize(values, scales, dtype=dtype)
    if values.dim() != 2 or tuple(scales.shape) != (values.shape[0],):
        raise ValueError(
            f"indexer_dequantize_keys: fp8 values must be [S, D] and scales [S]; "
            f"got {tuple(values.shape)}, {tuple(scales.shape)}"
        )
    return fp8_dequantize(values, scales[:, None], block_size=values.shape[1], dtype=dtype)


def pack_index_key_page(values: torch.Tensor, scales: torch.Tensor, *, fmt: str) -> torch.Tensor:
    """One cache page of index keys as bytes: uint8 [page_tokens * record_bytes].

    values / scales as `indexer_quantize_keys` returns them for the page's tokens; the page holds
    all value bytes (token-major) first, then all scale bytes (fp32 little-endian for fp8).
    """
    _check_fmt(fmt, "pack_index_key_page")
    S = values.shape[0] if values.dim() == 2 else -1
    if fmt == "fp8":
        dtypes, want = (torch.float8_e4m3fn, torch.float32), (S,)
    else:
        dtypes, want = (torch.uint8, torch.uint8), (S, values.shape[-1] * 2 // 32)
    if S < 0 or (values.dtype, scales.dtype) != dtypes or tuple(scales.shape) != want:
        raise ValueError(
            f"pack_index_key_page: {fmt} needs values {dtypes[0]} [S, D"
            f"{'' if fmt == 'fp8' else '/2'}] and scales {dtypes[1]} {want}; "
            f"got {values.dtype} {tuple(values.shape)} and {scales.dtype} {tuple(scales.shape)}"
        )
    value_bytes = values.contiguous().view(torch.uint8).reshape(-1)  # [S * D] or [S * D/2]
    scale_bytes = scales.contiguous().view(torch.uint8).reshape(-1)  # [S * 4] (D = 128)
    return torch.cat([value_bytes, scale_bytes])


def unpack_index_key_page(
    page: torch.Tensor, *, head_dim: int, fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_index_key_page`: uint8 [page_tokens * record_bytes] -> (values, scales).

    fp8: (float8_e4m3fn [S, D], fp32 [S]); mxfp4: (uint8 [S, D/2], uint8 [S, D/32]). Exact.
    """
    rec = index_key_record_bytes(head_dim, fmt)
    if page.dtype != torch.uint8 or page.dim() != 1 or page.numel() % rec:
        raise ValueError(
            f"unpack_index_key_page: page must be uint8 [page_tokens * {rec}] "
            f"({fmt}, D={head_dim}); got {page.dtype} {tuple(page.shape)}"
        )
    S = page.numel() // rec
    vbytes = head_dim if fmt == "fp8" else head_dim // 2
    values = page[: S * vbytes].reshape(S, vbytes).clone()  # copies: never alias the cache
    scales = page[S * vbytes :].clone()
    if fmt == "fp8":
        return values.view(torch.float8_e4m3fn), scales.view(torch.float32)  # [S, D], [S]
    return values, scales.reshape(S, head_dim // 32)


def indexer_scores(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    quantize_query: bool = True,
) -> torch.Tensor:
    """Oracle of `IndexerScores`: per sequence and per head, ReLU dot products weighted and summed,
    then the causal mask (one head at a time keeps memory at [Tq, Skv])."""
    op = "indexer_scores"
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(
            f"{op}: q must be [T, Hi, D] and keys [S, D]; got {tuple(q.shape)}, {tuple(keys.shape)}"
        )
    T, Hi, D = q.shape
    if tuple(head_weights.shape) != (T, Hi):
        raise ValueError(
            f"{op}: head_weights must be [T={T}, Hi={Hi}]; got {tuple(head_weights.shape)}"
        )
    spans = varlen_spans(cu_seqlens_q, cu_seqlens_kv, num_q=T, num_kv=keys.shape[0], op=op)
    cd = compute_dtype(q, head_weights, keys)
    qc, w = index_query(q, head_weights, quantize_query=quantize_query, dtype=cd)
    kc = upcast(keys, cd)
    max_kv = max((k1 - k0 for _, _, k0, k1 in spans), default=0)
    out = torch.full((T, max_kv), float("-inf"), dtype=cd, device=q.device)
    for q0, q1, k0, k1 in spans:
        if q1 == q0:
            continue
        kv_len = k1 - k0
        acc = torch.zeros(q1 - q0, kv_len, dtype=cd, device=q.device)  # [Tq, Skv]
        for h in range(Hi):  # one head at a time: memory stays [Tq, Skv]
            acc += w[q0:q1, h, None] * torch.relu(qc[q0:q1, h] @ kc[k0:k1].T)
        q_pos = torch.arange(kv_len - (q1 - q0), kv_len, device=q.device)
        causal = allowed_mask(q_pos, kv_len, max_kv=kv_len)  # [Tq, Skv]
        out[q0:q1, :kv_len] = acc.masked_fill(~causal, float("-inf"))
    return out


def indexer_decode_scores(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    quantize_query: bool = True,
) -> torch.Tensor:
    """Oracle of `IndexerDecodeScores`: the head-weighted ReLU dots against every padded key, then
    the seq_lens mask."""
    if q.dim() != 3 or keys.dim() != 3 or keys.shape[0] != q.shape[0] or keys.shape[2] != q.shape[2]:
        raise ValueError(f"indexer_decode_scores: q must be [N, Hi, D] and keys [N, L, D]; got "
                         f"{tuple(q.shape)}, {tuple(keys.shape)}")
    cd = compute_dtype(q, head_weights, keys)
    qc, w = index_query(q, head_weights, quantize_query=quantize_query, dtype=cd)
    dots = torch.einsum("nhd,nld->nhl", qc, upcast(keys, cd))            # [N, Hi, L]
    scores = (w[..., None] * torch.relu(dots)).sum(1)                     # [N, L]
    valid = torch.arange(keys.shape[1], device=q.device)[None, :] < seq_lens.to(q.device)[:, None]
    return scores.masked_fill(~valid, float("-inf"))


def indexer_paged_decode_scores(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    key_values: torch.Tensor,
    key_scales: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    fmt: str,
    quantize_query: bool = True,
) -> torch.Tensor:
    """Oracle of `IndexerPagedDecodeScores`: per sequence, its positions < seq_len read page by
    page through the block table, dequantised, scored as `indexer_decode_scores`."""
    _check_fmt(fmt, "indexer_paged_decode_scores")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0] or key_values.dim() != 3:
        raise ValueError(
            f"indexer_paged_decode_scores: block_table must be [N, max_pages] with N = {q.shape[0]} and "
            f"key_values [P, page, ...]; got {tuple(block_table.shape)}, {tuple(key_values.shape)}"
        )
    n, pages = block_table.shape
    page = key_values.shape[1]
    cd = compute_dtype(q, head_weights)
    out = torch.full((n, pages * page), float("-inf"), dtype=cd, device=q.device)
    for i, length in enumerate(seq_lens.tolist()):                     # host reads (the oracle may)
        pos = torch.arange(int(length), device=block_table.device)
        slots = (block_table[i, pos // page].long(), pos % page)       # each position's page and offset
        # gathered as bytes: torch 2.9's CPU cannot index float8 tensors (the torch-xla venv)
        values = key_values.view(torch.uint8)[slots].view(key_values.dtype)
        keys = indexer_dequantize_keys(values, key_scales[slots], fmt=fmt, dtype=cd)   # [L_i, D]
        scores = indexer_decode_scores(q[i: i + 1], head_weights[i: i + 1], keys[None], seq_lens[i: i + 1],
                                       quantize_query=quantize_query)  # [1, L_i]
        out[i, : int(length)] = scores[0]
    return out


def indexer_topk(scores: torch.Tensor, *, topk: int) -> torch.Tensor:
    """Oracle of `IndexerTopK`: a stable descending sort (equal scores keep position order), the
    first topk finite entries, -1 after them."""
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(
            f"indexer_topk: scores must be a float tensor [T, L]; "
            f"got {scores.dtype} {tuple(scores.shape)}"
        )
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"indexer_topk: topk must be a positive int, got {topk!r}")
    T, L = scores.shape
    finite = torch.isfinite(scores)
    clean = torch.where(finite, scores, float("-inf"))
    # a stable sort keeps equal scores in position order: ties go to the lower position
    vals, order = torch.sort(clean, dim=-1, descending=True, stable=True)  # [T, L]
    k = min(topk, L)
    idx = torch.where(torch.isfinite(vals[:, :k]), order[:, :k], -1).to(torch.int32)
    if k < topk:
        idx = torch.cat([idx, idx.new_full((T, topk - k), -1)], dim=1)
    return idx
