"""DSA indexer prefill scores in Triton: `IndexerKernels.scores` (see
k3.reference.indexer_scores for the contract).

    I(t, s) = sum_h w[t, h] * ReLU(q[t, h] . k[s]),   s <= the query's position,   -inf elsewhere

The reference loops over sequences and heads in torch; here one launch covers the packed batch.
Program (query token t, block of BLOCK_S key positions) multiplies the token's [Hi, D] query
rows by the block's [BLOCK_S, D] keys of its own sequence in one product ([Hi, BLOCK_S]),
applies ReLU and the head weights and sums over heads; a block wholly after the query's
position (or past its sequence's keys) is written as -inf without reading anything. The
sequences' spans are read on the host, as the reference does (prefill is scheduled there
anyway), into per-token rows: each query's first key row, key count and position.

The query is rounded to fp8 per (token, head) in torch first when asked (the reference's rule),
its scale folded into the head weight. Products: fp32 keys (dequantised fp8 times a per-token
scale, so not tf32-exact) use three-pass tf32 ("tf32x3", fp32-accurate on the tensor cores);
bf16 and fp16 inputs use tf32, exact for them. float64 and head counts or sizes that are not
powers of two (>= 16) go to the reference op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3 import reference as ref
from k3.dtypes import compute_dtype
from k3.ops_helpers import index_query, varlen_spans

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _prefill_scores_kernel(
    q_ptr, w_ptr, keys_ptr, key_start_ptr, key_count_ptr, pos_ptr, out_ptr,
    s_k, MAX_KV,
    HI: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    inside = s < MAX_KV
    first = tl.program_id(1) * BLOCK_S
    position = tl.load(pos_ptr + t)                              # the query's position in its sequence
    count = tl.load(key_count_ptr + t)
    visible = (s <= position) & (s < count)
    if (first > position) | (first >= count):                    # nothing visible in this block
        tl.store(out_ptr + t * MAX_KV + s, tl.full((BLOCK_S,), float("-inf"), tl.float32), mask=inside)
        return
    heads = tl.arange(0, HI)
    dims = tl.arange(0, D)
    start = tl.load(key_start_ptr + t).to(tl.int64)
    keys = tl.load(keys_ptr + (start + s)[:, None] * s_k + dims[None, :], mask=visible[:, None],
                   other=0.0).to(tl.float32)                                            # [BLOCK_S, D]
    q = tl.load(q_ptr + t * HI * D + heads[:, None] * D + dims[None, :])                  # [HI, D] fp32
    w = tl.load(w_ptr + t * HI + heads)                                                   # [HI]
    dots = tl.dot(q, tl.trans(keys), input_precision=PRECISION)                           # [HI, BLOCK_S]
    score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], 0)
    tl.store(out_ptr + t * MAX_KV + s, tl.where(visible, score, float("-inf")), mask=inside)


def covers(q, head_weights, keys) -> bool:
    """The inputs this kernel computes; anything else goes to the reference op."""
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2] or head_weights.dim() != 2:
        return False
    hi, d = q.shape[1:]
    return (all(x.dtype in _DTYPES for x in (q, head_weights, keys)) and keys.stride(1) == 1
            and hi >= 16 and d >= 16 and hi & (hi - 1) == 0 and d & (d - 1) == 0)


def indexer_scores(q, head_weights, keys, *, cu_seqlens_q, cu_seqlens_kv, quantize_query=True, block_s=64,
                   precisions=("tf32", "tf32x3")):
    """`k3.reference.indexer_scores` in Triton (same signature and contract).

    block_s: key positions per program (a launch option for benchmarks). precisions: the dots'
    input precision (Triton's names) where tf32 is exact for the inputs and where it is not
    (fp32 keys); a launch option for platform tables (AMD: "tf32" exists on gfx942 only,
    "tf32x3" on NVIDIA only, so AMD passes "ieee" where this default cannot compile).
    """
    if not covers(q, head_weights, keys) or tuple(head_weights.shape) != tuple(q.shape[:2]):
        return ref.indexer_scores(q, head_weights, keys, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                                  quantize_query=quantize_query)
    t, hi, d = q.shape
    spans = varlen_spans(cu_seqlens_q, cu_seqlens_kv, num_q=t, num_kv=keys.shape[0], op="indexer_scores")
    max_kv = max((k1 - k0 for _, _, k0, k1 in spans), default=0)
    # per query token: its sequence's first key row, key count and its own position (the last
    # q_len tokens of the sequence are the queries)
    key_start, key_count, position = [], [], []
    for q0, q1, k0, k1 in spans:
        n_q, n_kv = q1 - q0, k1 - k0
        key_start += [k0] * n_q
        key_count += [n_kv] * n_q
        position += range(n_kv - n_q, n_kv)
    dev = q.device
    as_rows = lambda values: torch.tensor(values, dtype=torch.int32, device=dev)  # noqa: E731
    cd = compute_dtype(q, head_weights, keys)
    qc, w = index_query(q, head_weights, quantize_query=quantize_query, dtype=cd)
    out = torch.empty(t, max_kv, dtype=cd, device=dev)
    exact_in_tf32 = keys.dtype != torch.float32 and (quantize_query or q.dtype != torch.float32)
    if t and max_kv:
        _prefill_scores_kernel[(t, triton.cdiv(max_kv, block_s))](
            qc.contiguous(), w.contiguous(), keys, as_rows(key_start), as_rows(key_count), as_rows(position), out,
            keys.stride(0), max_kv,
            HI=hi, D=d, BLOCK_S=block_s, PRECISION=precisions[0] if exact_in_tf32 else precisions[1],
            num_warps=4 if exact_in_tf32 else 8,              # tf32x3 spills at 4 warps (bench/ptxas_report.py)
        )
    return out
