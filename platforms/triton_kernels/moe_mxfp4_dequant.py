"""Routed experts for prefill-sized batches (`moe_mxfp4.experts_forward`'s "dequant" mode): the
active experts' MXFP4 weights dequantised to bf16 a group at a time by one Triton launch, then
multiplied by the tokens routed to them as grouped matrix products on the vendor's library.

Why: the in-kernel modes (moe_mxfp4.py) upcast the E2M1 codes inside every tile; at prefill
sizes (an 8K-token chunk of k3-slice routes ~1,000 tokens to each of 128 experts) that upcast
is repeated per token tile and the kernels run at ~19% of the H200's bf16 matrix-product rate.
Dequantising an expert costs its bf16 bytes once (66 MB at k3-slice's dimensions, ~20 us at
the copy bandwidth), after which the library multiplies at its own rate.

Measured on the H200 at k3-slice's dimensions (bench/moe_mxfp4.py), the first version, one
active expert at a time (a dequantising launch per weight, a gather, two cuBLAS products, the
activation, the weighting: about ten launches each): 56.0 ms at 8,192 tokens against 66.2 ms
for the 64-token tiles, but 65.3 ms against 18.2 ms at 2,048: ~0.35 ms an expert whatever its
tokens, so the loop, not the 12.6 ms of products, bounded it. This version batches the experts:
  1. the experts with tokens are cut into groups whose bf16 weights (w13 and w2 counted
     together, though one is freed before the other is made) stay under GROUP_BYTES (2 GiB: 32
     of k3-slice's 66 MB experts, so 128 active experts are four groups), a bound on the
     transient memory (the group's activations, [n, 2I] + [n, I] + [n, L] bf16 for its n
     (token, choice) rows, come on top: ~0.8 GB a group at 8,192 tokens);
  2. per group, one launch dequantises w13 of all its experts into a [G, 2I, L] bf16 buffer
     (grid: expert of the group x row blocks x column blocks, the experts read from an int32
     device tensor), one grouped product multiplies the group's (token, choice) rows, sorted by
     expert, by it (`torch._grouped_mm`, int32 offsets; where it does not run, a loop of plain
     products over the same buffer and offsets), one launch applies the activation (glu.py),
     then the same for w2;
so a call is about a dozen launches a group rather than ten an expert. Measured (H200, k3-slice,
bench/moe_mxfp4.py and bench/moe_dequant_profile.py): 23.5 ms at 8,192 tokens (54% of the
bf16 matrix-product rate; the grouped products 11.7 ms, the dequantising launches 3.6 ms for
all 128 experts' 8.4 GB of bf16, the gathers, weighting and sum the rest), 10.4 ms at 2,048 and
8.6 ms at 1,024, where the 64-token tiles take 66.2, 18.2 and 10.1 ms. The dequantising kernel
first stored the low and high nibbles' values as two stores of every other element (2-byte
halves of each word): 31.4 ms for the same bytes, now one store of whole interleaved rows.

The rounding points are the model's dense FFN's (`k3.reference.glu_mlp`), unchanged by the
grouping: the gate/up product, the activation and the down product each rounded to bf16,
products accumulated in fp32 (cuBLAS and the grouped CUTLASS kernel alike); the bf16 weights
are exact (every MXFP4 value times its E8M0 scale is a bf16). The k routed rows of a token are
weighted in fp32 and summed in a fixed order (no atomics), as the other modes.

The host reads how many tokens each expert got (one synchronisation per call) to form the
groups and their offsets: prefill is not captured in a CUDA graph, and decode batches never take
this mode.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from k3.quant.mxfp4 import MXFP4Tensor

from . import glu
from .moe_mxfp4_layout import tiles_of
from .moe_mxfp4_common import (e2m1_over_16384, e8m0_multiplier, pairs_by_local_expert, pairs_per_local_expert,
                               tile_major_row)

BLOCK_ROWS = 16
BLOCK_BYTES = 128           # 256 weights of a row per program (a multiple of a 16-byte scale group)
GROUP_BYTES = 2 << 30       # cap on one group's bf16 weights (w13 + w2): 32 k3-slice experts (module docstring)
GROUPED_MM_MAX_EXPERTS = 1023   # torch._grouped_mm's CUTLASS kernel takes fewer than 1,024 groups


@triton.jit
def _dequantize_kernel(packed_ptr, scales_ptr, ids_ptr, out_ptr, rows, s_pe, s_pr, s_se, s_sr, s_oe, s_or,
                       HALF_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                       TILED: tl.constexpr = False):
    """out[g, r, 2j] / out[g, r, 2j + 1] = low / high nibble of packed[e, r, j] times
    2^(scale - 127) of its 32-column group, e = ids[g] (program_id(0)), for BLOCK_ROWS rows
    (program_id(1)) x BLOCK_BYTES bytes (program_id(2)) per program. TILED: packed and scales
    are tile-major (`k3.quant.mxfp4_tiles`; s_pr, s_sr unused): byte j of row r
    in column tile j / 32 of row tile r / 128, 32 bytes a row there (scales: 2)."""
    g = tl.program_id(0)
    e = tl.load(ids_ptr + g).to(tl.int64)        # e * expert stride can pass 2^31 (k3-slice w13: 1.4e9 bytes)
    r = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    j = tl.program_id(2) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    mask = (r < rows)[:, None] & (j < HALF_COLS)[None, :]
    r64 = r.to(tl.int64)[:, None]
    if TILED:
        row_at = tile_major_row(r64, 2 * HALF_COLS)
        code_at = row_at * 32 + ((j // 32) * (128 * 32) + j % 32)[None, :]
        scale_at = row_at * 2 + ((j // 32) * (128 * 2) + (j // 16) % 2)[None, :]
    else:
        code_at = r64 * s_pr + j[None, :]
        scale_at = r64 * s_sr + (j // 16)[None, :]
    packed = tl.load(packed_ptr + e * s_pe + code_at, mask=mask, other=0).to(tl.int32)             # [R, B]
    scale = tl.load(scales_ptr + e * s_se + scale_at, mask=mask, other=127).to(tl.int32)
    mult = e8m0_multiplier(scale)
    lo = (e2m1_over_16384(packed & 15) * 16384.0) * mult
    hi = (e2m1_over_16384(packed >> 4) * 16384.0) * mult
    # interleaved in registers ([R, B, 2] -> [R, 2B]) and stored as whole rows: two stores of
    # every other element instead wrote 2-byte halves of each word (measured 31 ms for k3-slice's
    # 128 experts on the H200, 12x their bytes over the copy bandwidth)
    pairs = tl.reshape(tl.join(lo, hi), (BLOCK_ROWS, 2 * BLOCK_BYTES)).to(out_ptr.dtype.element_ty)
    cols = 2 * tl.program_id(2) * BLOCK_BYTES + tl.arange(0, 2 * BLOCK_BYTES)
    out = out_ptr + g.to(tl.int64) * s_oe + r64 * s_or + cols[None, :]
    tl.store(out, pairs, mask=(r < rows)[:, None] & (cols < 2 * HALF_COLS)[None, :])


def dequantize_experts(w: MXFP4Tensor, ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Experts `ids` (int32 [G] on w's device) of an [E, R, C] MXFP4Tensor (the checkpoint layout,
    or tile-major: `k3.quant.mxfp4_tiles`) as a dense [G, R, C] tensor of `dtype`, in one launch."""
    # [E, R, C/2] u8 and [E, R, C/32] u8, or tile-major [E, R/128, C/64, 128, 32 | 2] u8
    packed, scales = w.packed, w.scales
    rows, half = w.shape[1], w.shape[2] // 2
    if packed.stride(-1) != 1 or scales.stride(-1) != 1:
        raise ValueError("dequantize_experts: the packed codes and scales need contiguous rows")
    if ids.dtype != torch.int32 or ids.dim() != 1:
        raise ValueError(f"dequantize_experts: ids must be a 1-D int32 tensor, got {ids.dtype} {tuple(ids.shape)}")
    out = torch.empty(ids.numel(), rows, 2 * half, dtype=dtype, device=packed.device)     # [G, R, C]
    if out.numel():
        grid = (ids.numel(), triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(half, BLOCK_BYTES))
        _dequantize_kernel[grid](packed, scales, ids, out, rows, packed.stride(0), packed.stride(-2), scales.stride(0),
                                 scales.stride(-2), *out.stride()[:2], HALF_COLS=half, BLOCK_ROWS=BLOCK_ROWS,
                                 BLOCK_BYTES=BLOCK_BYTES, TILED=tiles_of(w) is not None, num_warps=4)
    return out


def dequantize_expert(w: MXFP4Tensor, e: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Expert e of an [E, R, C] MXFP4Tensor as a dense [R, C] tensor of `dtype` (one launch)."""
    ids = torch.full((1,), e, dtype=torch.int32, device=w.packed.device)       # filled there: no host copy
    return dequantize_experts(w, ids, dtype)[0]


_GROUPED_MM_RUNS: dict[tuple[torch.device, torch.dtype], bool] = {}


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` (2-D rows x 3-D weights, int32 offsets) runs and is right on
    this device for this dtype: tried once on a small exact problem (small integers, so any
    fp32 accumulation gives the same bits) and remembered for the process. Decided by trying
    rather than by the platform's name or its capability, since what runs depends on the torch
    build as much as on the device: torch's CUDA build runs bf16 on sm90 / sm100 with a CUTLASS
    kernel (the H200's), and elsewhere (in recent releases) with its own loop of products that
    reads the offsets on the host; the CPU build loops too (torch 2.13); builds without the op,
    or where it raises or disagrees, get `grouped_matmul`'s own loop instead."""
    key = (torch.device(device), dtype)
    if key not in _GROUPED_MM_RUNS:
        _GROUPED_MM_RUNS[key] = _try_grouped_mm(key[0], dtype)
    return _GROUPED_MM_RUNS[key]


def _try_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-4, 5, (48, 64), generator=g).to(device=device, dtype=dtype)            # [n, K]
    w = torch.randint(-4, 5, (3, 32, 64), generator=g).to(device=device, dtype=dtype)         # [G, N, K]
    ends = [16, 21, 48]                          # groups of 16, 5 and 27 rows (as the experts': never empty)
    try:
        got = grouped_matmul(a, w, ends, torch.tensor(ends, dtype=torch.int32, device=device), grouped=True)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    want = torch.cat([a[s:e] @ w[g].T for g, (s, e) in enumerate(zip([0] + ends, ends))])
    return got.shape == want.shape and bool(torch.equal(got, want))


def grouped_matmul(a: torch.Tensor, w: torch.Tensor, ends: list[int], ends_dev: torch.Tensor | None, *,
                   grouped: bool | None = None) -> torch.Tensor:
    """Rows of a [n, K] sorted by group (group g's rows end at ends[g]; ends[-1] == n) times
    their group's weights w[g] [N, K] transposed: [n, N] in a's dtype, accumulated in fp32 (as
    `a @ w[g].T`). grouped: one `torch._grouped_mm` (ends_dev: `ends` as int32 on a's device),
    False a loop of plain products over the same buffer, None `grouped_mm_runs`.

    torch._grouped_mm (2-D mat_a x 3-D mat_b): mat_b is [G, K, N] (here w's transposed view,
    column-major, which the op takes as it is), offs[g] the end row of group g in mat_a (rows
    past offs[-1] are not written); CUDA needs 16-byte aligned data pointers and row strides
    that are multiples of 16 bytes (fresh tensors, K and N multiples of 32: `moe_mxfp4.covers`)
    and fewer than 1,024 groups (GROUPED_MM_MAX_EXPERTS)."""
    if grouped is None:
        grouped = grouped_mm_runs(a.device, a.dtype)
    if grouped:
        return torch._grouped_mm(a, w.transpose(1, 2), offs=ends_dev)                         # [n, N]
    out = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)                 # [n, N]
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            torch.mm(a[start:end], w[g].T, out=out[start:end])
        start = end
    return out


def expert_groups(counts: list[int], expert_bytes: int) -> list[list[int]]:
    """The experts with tokens (counts [E_local] on the host), in order, cut into groups of
    GROUP_BYTES // expert_bytes experts (expert_bytes: one expert's bf16 w13 and w2), at least one
    (an expert over the cap is a group of its own) and at most GROUPED_MM_MAX_EXPERTS."""
    per_group = max(1, min(GROUP_BYTES // expert_bytes, GROUPED_MM_MAX_EXPERTS))
    active = [e for e, count in enumerate(counts) if count]
    return [active[i: i + per_group] for i in range(0, len(active), per_group)]


def experts_forward(x, w13: MXFP4Tensor, w2: MXFP4Tensor, topk_weights, topk_ids, *, activation, beta=None,
                    linear_beta=None, expert_start=0, grouped=None):
    """`k3.reference.experts_forward` for bf16 activations over MXFP4 experts (its contract), a
    group of active experts at a time (`expert_groups`): dequantise w13 of the group, its
    (token, choice) rows @ w13[e]^T as one grouped product, the gated activation (glu.py),
    dequantise w2 of the group, @ w2[e]^T, each rounded to bf16 (module docstring).
    grouped: `grouped_matmul`'s (None: torch._grouped_mm where it runs). w13 and w2 may be
    tile-major (`k3.quant.mxfp4_tiles`)."""
    t, l = x.shape
    e_local, two_i, topk = w13.shape[0], w13.shape[1], topk_ids.shape[1]
    local, order = pairs_by_local_expert(topk_ids, expert_start, e_local)            # [T*k], pairs sorted by expert
    counts_dev = pairs_per_local_expert(local, e_local)[:e_local]                       # [E_local] pairs per expert
    counts = counts_dev.tolist()                                                       # the host synchronisation
    starts = [0, *itertools.accumulate(counts)]                # expert e's pairs: order[starts[e]:starts[e + 1]]
    groups = expert_groups(counts, 2 * (two_i * l + w2.shape[1] * w2.shape[2]))
    # the same on the device, computed there (a copy from the host would synchronise again): the
    # experts with pairs in order (a stable sort puts them first) and where their pairs end
    active_dev = torch.argsort((counts_dev == 0).int(), stable=True).int()            # [E_local] int32
    active_ends = torch.cumsum(counts_dev, 0).int()[active_dev]                       # [E_local] int32
    weights = topk_weights.reshape(-1).to(torch.float32)
    y = torch.zeros(t * topk, l, dtype=torch.float32, device=x.device)                # rows of other ranks stay 0
    done = 0                                                                          # active experts so far
    for ids in groups:
        first, last = starts[ids[0]], starts[ids[-1] + 1]
        ends = [starts[e + 1] - first for e in ids]                                   # the group's row ends
        ids_dev = active_dev[done: done + len(ids)]                                   # int32 [G]: ids
        ends_dev = active_ends[done: done + len(ids)] - first                         # int32 [G]: ends
        done += len(ids)
        pairs = order[first:last]                                                     # [n] (token, choice), by expert
        h13 = grouped_matmul(x[pairs // topk], dequantize_experts(w13, ids_dev), ends, ends_dev,
                             grouped=grouped)                                         # [n, 2I] bf16
        a = glu.glu_activation(h13, activation=activation, beta=beta, linear_beta=linear_beta)   # [n, I] bf16
        del h13
        o = grouped_matmul(a, dequantize_experts(w2, ids_dev), ends, ends_dev, grouped=grouped)  # [n, L]
        y[pairs] = o.float() * weights[pairs, None]
    return y.view(t, topk, l).sum(1).to(x.dtype)
