"""Absorbed MLA decode over a paged latent cache in Triton: `MLAKernels.decode` (see
k3.reference.mla_decode for the contract).

The weight absorptions stay batched matmuls in torch (q_nope w_uk before, out w_uv after); the
kernel is the attention in between, MQA over the shared latent rows: split-K flash decoding.
Program (query token, block of BLOCK_H heads, split s of `splits`) walks its share of the
query's positions (the causal length divided into `splits` equal runs of whole BLOCK_N blocks,
computed on the device) BLOCK_N at a time through the block table (a loop of constant trip
count SPLIT_LEN, a power of two no smaller than any share, whose blocks past the share skip),
loads each latent row once for all its heads (bf16 / fp16 / fp32, or fp8 times the cache's scale), scores the latent part and the RoPE
part with two dots, and keeps an online softmax; the splits are merged by their log-sum-exp in
one more launch (or, `merge="torch"`, by a dozen torch operations). Positions past the sequence or after the query (speculative verify) are masked. With
DSA indices the programs walk the selection instead of the context (sparse: k rows read per
query, not the whole context); duplicates and out-of-range entries are dropped on the device
first (the reference selects a position once). A split whose share is empty returns at once.
The number of splits depends only on the batch (enough programs to fill the device, at most
MAX_SPLITS), not on the block table's width, so the partial results take t x H x splits x R
floats however long max_model_len is (a CUDA graph captured for a padded table keeps them).

The softmax runs in base 2 with its running maximum rounded up to a whole number: p =
2^(s log2(e) - m) with m an integer, so every rescaling of the running sums is an exact power of
two and the bf16 (or tf32) rounding of p before the product with the latents is the same
whichever split a position falls in and whatever maximum that split has seen (a power of two
commutes with rounding). With the maximum itself subtracted (the usual form) p was rounded
relative to each split's own maximum, so a query's result changed with the split count, that is
with its batch company (issue 32); now splits differ only in fp32 summation order. K3_LEGACY_ROUNDING
(`rounding.legacy`) restores the split-relative form for the before/after measurement.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from k3.platforms.torch_kernels import mla_decode as torch_decode
from k3.platforms.torch_kernels.mla_selection import query_positions, unique_selection

from . import rounding

_QUERIES = (torch.bfloat16, torch.float16, torch.float32)
_CACHES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
MAX_SPLITS = 64
LOG2E = 1.4426950408889634


@triton.jit
def _mla_split_kernel(
    q_ptr, kv_ptr, table_ptr, lens_ptr, seq_of_ptr, q_pos_ptr, sel_ptr, o_ptr, lse_ptr,
    s_qt, s_qh, s_kp, s_ko, s_bt, s_st, s_ot, s_oh, s_os, s_lt, s_lh,
    H, NUM_SEL, SPLITS, scale, kv_scale_ptr,
    PAGE: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_LEN: tl.constexpr, SPARSE: tl.constexpr, IEEE: tl.constexpr, NATIVE: tl.constexpr,
    WHOLE_MAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    mask_h = heads < H
    n = tl.load(seq_of_ptr + t)
    end = tl.minimum(tl.load(lens_ptr + n), tl.load(q_pos_ptr + t) + 1)          # positions < end are causal
    o_ptrs = o_ptr + t * s_ot + heads[:, None] * s_oh + split * s_os + tl.arange(0, R)[None, :]
    lse_ptrs = lse_ptr + t * s_lt + heads * s_lh + split
    if SPARSE:                              # dense: positions; SPARSE: entries of the selection
        limit = NUM_SEL
    else:
        limit = end
    share = tl.cdiv(tl.cdiv(limit, SPLITS), BLOCK_N) * BLOCK_N           # whole blocks per split
    start = split * share
    stop = tl.minimum(start + share, limit)
    if start >= stop:
        tl.store(o_ptrs, tl.zeros((BLOCK_H, R), dtype=tl.float32), mask=mask_h[:, None])
        tl.store(lse_ptrs, tl.full((BLOCK_H,), float("-inf"), tl.float32), mask=mask_h)
        return
    lat = tl.arange(0, R)
    rope = tl.arange(0, DR)
    kv_scale = tl.load(kv_scale_ptr)
    q_lat = tl.load(q_ptr + t * s_qt + heads[:, None] * s_qh + lat[None, :], mask=mask_h[:, None], other=0.0)
    q_pe = tl.load(q_ptr + t * s_qt + heads[:, None] * s_qh + R + rope[None, :], mask=mask_h[:, None], other=0.0)
    if NATIVE:                              # bf16 operands: the query rounded once, the rows as stored
        q_lat = q_lat.to(tl.bfloat16)
        q_pe = q_pe.to(tl.bfloat16)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, R), dtype=tl.float32)
    for jj in range(0, SPLIT_LEN, BLOCK_N):  # constexpr trip count; blocks past the share skip
        j = start + jj
        if j < stop:
            if SPARSE:                          # selected positions, -1 for padding and duplicates
                entry = j + tl.arange(0, BLOCK_N)
                pos = tl.load(sel_ptr + t * s_st + entry, mask=entry < stop, other=-1)
                valid = (pos >= 0) & (pos < end)
            else:
                pos = j + tl.arange(0, BLOCK_N)
                valid = pos < stop
            page = tl.load(table_ptr + n * s_bt + pos // PAGE, mask=valid, other=0).to(tl.int64)
            row = kv_ptr + page * s_kp + (pos % PAGE) * s_ko
            if NATIVE:      # bf16 rows (fp8 codes widen exactly); the scale goes on scores and output
                k_lat = tl.load(row[:, None] + lat[None, :], mask=valid[:, None], other=0.0).to(tl.bfloat16)
                k_pe = tl.load(row[:, None] + R + rope[None, :], mask=valid[:, None], other=0.0).to(tl.bfloat16)
                scores = (tl.dot(q_lat, tl.trans(k_lat)) + tl.dot(q_pe, tl.trans(k_pe))) * kv_scale
            else:
                k_lat = tl.load(row[:, None] + lat[None, :], mask=valid[:, None], other=0.0).to(tl.float32) * kv_scale
                k_pe = tl.load(row[:, None] + R + rope[None, :], mask=valid[:, None], other=0.0).to(tl.float32) * kv_scale
                if IEEE:
                    scores = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
                    scores += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
                else:
                    scores = tl.dot(q_lat, tl.trans(k_lat), input_precision="tf32")
                    scores += tl.dot(q_pe, tl.trans(k_pe), input_precision="tf32")
            scores = tl.where(valid[None, :], scores * scale, float("-inf"))             # in log2 units
            block_max = tl.max(scores, 1)
            if WHOLE_MAX:                   # a whole number: p rounds the same in every split (module docstring)
                block_max = tl.ceil(block_max)
            m_new = tl.maximum(m, block_max)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)                        # nothing allowed yet
            alpha = tl.exp2(m - shift)
            p = tl.exp2(scores - shift[:, None])
            total = total * alpha + tl.sum(p, 1)
            if NATIVE:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), k_lat) * kv_scale
            elif IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, k_lat, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p, k_lat, input_precision="tf32")
            m = m_new
    safe = tl.where(total > 0, total, 1.0)
    tl.store(o_ptrs, acc / safe[:, None], mask=mask_h[:, None])
    tl.store(lse_ptrs, tl.where(total > 0, m + tl.log2(safe), float("-inf")), mask=mask_h)    # log2


@triton.jit
def _merge_splits_kernel(o_ptr, lse_ptr, out_ptr, s_ot, s_oh, s_os, s_lt, s_lh, T, SPLITS,
                         R: tl.constexpr, S_PAD: tl.constexpr, R_CHUNK: tl.constexpr, HI_LO: tl.constexpr):
    """The splits of (query t, head h) = program (0, 1) merged by their log-sum-exp (base 2), as the
    torch merge does (weights 2^(lse - max), all-empty rows to zero): out [T, H, R] fp32, or with HI_LO
    the result as two 16-bit parts hi + lo (out's dtype) at out[h, t] and out[h, T + t] of an
    [H, 2T, R] operand, ready for one per-head product with w_uv."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, S_PAD)
    present = splits < SPLITS
    lse = tl.load(lse_ptr + t * s_lt + h * s_lh + splits, mask=present, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)      # every split empty: all weights exp(-inf) = 0
    weight = tl.exp2(lse - top)                                                    # [S_PAD]
    inv_total = 1.0 / tl.maximum(tl.sum(weight, 0), 1.1754943508222875e-38)        # clamp_min(fp32 tiny)
    for c0 in tl.static_range(0, R, R_CHUNK):
        cols = c0 + tl.arange(0, R_CHUNK)
        part = tl.load(o_ptr + t * s_ot + h * s_oh + splits[:, None] * s_os + cols[None, :], mask=present[:, None],
                       other=0.0)                                                  # [S_PAD, R_CHUNK]
        out = tl.sum(weight[:, None] * part, 0) * inv_total
        if HI_LO:
            hi = out.to(out_ptr.dtype.element_ty)
            lo = (out - hi.to(tl.float32)).to(out_ptr.dtype.element_ty)
            row = out_ptr + h * (2 * T) * R + t * R
            tl.store(row + cols, hi)
            tl.store(row + T * R + cols, lo)
        else:
            tl.store(out_ptr + (t * tl.num_programs(1) + h) * R + cols, out)


def covers(q_nope, q_pe, kv_cache, w_uk) -> bool:
    """The inputs this kernel computes; anything else goes to the reference op."""
    r, dr = w_uk.shape[-1], q_pe.shape[-1]
    return (q_nope.dtype in _QUERIES and kv_cache.dtype in _CACHES and r >= 16 and dr >= 16
            and r & (r - 1) == 0 and dr & (dr - 1) == 0 and kv_cache.stride(-1) == 1)


@functools.lru_cache(maxsize=None)
def _processors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the interpreter on the CPU: 4)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def split_count(t: int, head_blocks: int, positions: int, block_n: int, device: torch.device) -> int:
    """Splits per (query, head block): about 8 programs per processor over the whole launch, at
    most MAX_SPLITS and at most one per BLOCK_N positions of the table (or selection)."""
    want = triton.cdiv(8 * _processors(device), max(t, 1) * head_blocks)
    return max(1, min(MAX_SPLITS, triton.cdiv(positions, block_n), want))


def mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, w_uk, w_uv, *, scale, cu_seqlens_q=None,
               kv_cache_scale=None, topk_indices=None, operands="fp32", merge="triton", ieee=None, block_n=32):
    """`k3.reference.mla_decode` with the attention in Triton (same signature and contract).

    operands (a launch option for benchmarks): "fp32" (the default: rows widened to fp32, tf32
    products; IEEE for fp32 models) or "native" (bf16 and fp8 caches: bf16 tensor-core products
    straight from the stored rows, the query and the softmax weights rounded to bf16, the fp8
    scale applied to the scores and the output; fp32 caches keep "fp32").
    block_n: positions per step of a program (a launch option for platform tables: AMD takes 16,
    which compiles without spills where 32 spills 19-41 registers, docs/amd.md).
    merge: "triton" (the default: one `_merge_splits_kernel` launch writing the merged fp32 latent
    as hi + lo 16-bit parts of one operand, then one product with w_uv: about 13 fewer launches a
    layer than "torch"; on the H200 107 vs 138 us at one sequence of 8K, BENCHMARKS.md) or "torch"
    (the splits merged by a dozen torch operations, the latent's two parts multiplied apart).
    """
    if merge not in ("torch", "triton"):
        raise ValueError(f"mla_decode: merge must be 'torch' or 'triton', got {merge!r}")
    if operands not in ("fp32", "native"):
        raise ValueError(f"mla_decode: operands must be 'fp32' or 'native', got {operands!r}")
    if not covers(q_nope, q_pe, kv_cache, w_uk):
        return torch_decode.mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, w_uk, w_uv, scale=scale,
                              cu_seqlens_q=cu_seqlens_q, kv_cache_scale=kv_cache_scale, topk_indices=topk_indices)
    is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    # bf16 tensor-core operands only for a 16-bit model: an fp32 model rounds nowhere but at fp32
    # (DESIGN.md "Numerics"), so its fp8 pages widen to fp32 operands like an fp32 cache's
    native = (operands == "native" and kv_cache.dtype in (torch.bfloat16, torch.float8_e4m3fn)
              and q_nope.dtype in (torch.bfloat16, torch.float16))
    if is_fp8 and kv_cache_scale is None:
        raise ValueError(f"mla_decode: an fp8 kv_cache ({kv_cache.dtype}) needs a kv_cache_scale")
    t, h, _ = q_nope.shape
    r, dr = w_uk.shape[-1], q_pe.shape[-1]
    page = kv_cache.shape[1]
    max_kv = block_table.shape[1] * page
    dev = q_nope.device
    lens = seq_lens.long()
    seq_of, q_pos = query_positions(t, seq_lens, cu_seqlens_q)
    # sorted, each position once; padding, duplicates and positions past the table become -1
    selection = None if topk_indices is None else unique_selection(topk_indices, max_kv)
    q_lat = _per_head_fp32(q_nope, w_uk)                                                      # [T, H, R] fp32
    q_full = torch.cat([q_lat, q_pe.float()], -1).contiguous()                                # [T, H, R+Dr]
    positions = max_kv if selection is None else selection.shape[1]
    block_h = 16
    splits = split_count(t, triton.cdiv(h, block_h), positions, block_n, dev)
    # the loop's trip count, a power of two (few compilations) covering every split's share
    split_len = max(block_n, triton.next_power_of_2(triton.cdiv(positions, splits)))
    o_part = torch.empty(t, h, splits, r, dtype=torch.float32, device=dev)
    lse = torch.empty(t, h, splits, dtype=torch.float32, device=dev)
    if t:
        # a per-tensor scale stays on the device (reading it on the host would synchronise)
        kv_scale = (kv_cache_scale.reshape(1).float() if isinstance(kv_cache_scale, torch.Tensor)
                    else torch.full((1,), float(kv_cache_scale) if is_fp8 else 1.0, device=dev))
        _mla_split_kernel[(t, triton.cdiv(h, block_h), splits)](
            q_full, kv_cache, block_table, lens, seq_of, q_pos, selection if selection is not None else lens, o_part,
            lse, q_full.stride(0), q_full.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
            selection.stride(0) if selection is not None else 0, *o_part.stride()[:3], lse.stride(0), lse.stride(1),
            h, positions, splits, float(scale) * LOG2E, kv_scale,
            PAGE=page, R=r, DR=dr, BLOCK_H=block_h, BLOCK_N=block_n, SPLIT_LEN=split_len, SPARSE=selection is not None,
            IEEE=q_nope.dtype == torch.float32 if ieee is None else bool(ieee), num_warps=8 if r >= 256 else 4,
            NATIVE=native,
            WHOLE_MAX=not rounding.legacy(),
        )
    if merge == "triton" and t:
        return _merge_then_absorb(o_part, lse, w_uv, q_nope.dtype)
    top = lse.amax(-1, keepdim=True)
    weight = torch.exp2(lse - torch.where(torch.isfinite(top), top, 0.0))                    # [T, H, S]
    out_lat = (weight[..., None] * o_part).sum(2) / weight.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    if out_lat.dtype != w_uv.dtype and w_uv.dtype in (torch.bfloat16, torch.float16):
        # the fp32 latent as two 16-bit parts (hi + lo holds it to about 2^-16), each multiplied
        # with fp32 results: no fp32 copy of w_uv each step
        hi = out_lat.to(w_uv.dtype)
        lo = (out_lat - hi.float()).to(w_uv.dtype)
        return (_per_head_fp32(hi, w_uv) + _per_head_fp32(lo, w_uv)).to(q_nope.dtype)
    return _per_head_fp32(out_lat, w_uv).to(q_nope.dtype)


def _merge_then_absorb(o_part: torch.Tensor, lse: torch.Tensor, w_uv: torch.Tensor, dtype: torch.dtype):
    """merge="triton": the splits merged in one launch, then out latent [T, H, R] x w_uv [H, R, Dv]
    in fp32 ([T, H, Dv] of dtype). A 16-bit w_uv takes the latent as hi + lo parts stacked along
    the rows of one [H, 2T, R] operand (one product, the halves added); an fp32 one, as it is."""
    t, h, splits, r = o_part.shape
    hi_lo = w_uv.dtype in (torch.bfloat16, torch.float16)
    out = torch.empty((h, 2 * t, r) if hi_lo else (t, h, r), dtype=w_uv.dtype if hi_lo else torch.float32,
                      device=o_part.device)
    _merge_splits_kernel[(t, h)](o_part, lse, out, *o_part.stride()[:3], *lse.stride()[:2], t, splits,
                                 R=r, S_PAD=triton.next_power_of_2(splits), R_CHUNK=min(r, 64), HI_LO=hi_lo,
                                 num_warps=4)
    if not hi_lo:
        return _per_head_fp32(out, w_uv).to(dtype)
    y = _per_head_fp32(out.transpose(0, 1), w_uv)                                             # [2T, H, Dv]
    return (y[:t] + y[t:]).to(dtype)


def mla_decode_native(q_nope, q_pe, kv_cache, block_table, seq_lens, w_uk, w_uv, *, scale, cu_seqlens_q=None,
                      kv_cache_scale=None, topk_indices=None, merge="triton"):
    """`mla_decode` with operands="native", the nvidia platform's served `mla.decode`: bf16
    tensor-core products straight from bf16 and fp8 cache rows (fp32 caches keep fp32; on the
    H200 1.0-1.6x the fp32 operands, most on fp8 pages, BENCHMARKS.md)."""
    return mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, w_uk, w_uv, scale=scale,
                      cu_seqlens_q=cu_seqlens_q, kv_cache_scale=kv_cache_scale, topk_indices=topk_indices,
                      operands="native", merge=merge)


def _per_head_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, A] times w [H, A, B] per head, in fp32: [T, H, B]. 16-bit operands of one dtype
    on a GPU multiply as they are with fp32 results (torch.bmm's out_dtype: exact products, fp32
    sums, as the upcast would give) instead of upcasting w, which copied the absorbed weights to
    fp32 on every decode step (~0.1-0.2 ms a k3-slice step, BENCHMARKS.md)."""
    if x.is_cuda and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(x.transpose(0, 1), w, out_dtype=torch.float32).transpose(0, 1)
    return torch.einsum("tha,hab->thb", x.float(), w.float())
