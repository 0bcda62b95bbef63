"""LoRA adapters in Triton (`LoRAKernels`, `k3.plugin.kernels.lora`): punica / SGMV-style
grouped shrink and expand, and the routed experts with per-expert adapters grouped like the
base experts.

Rows are grouped on the device by the adapter weights they use (`group_tiles`: a stable argsort
of the group ids, counts by scatter-add, tiles of BLOCK_T rows of one group, the same tile
machinery as the MXFP4 experts, `moe_mxfp4_common.expert_tiles`): no host synchronisation, so
the grid is sized for the worst case and idle tiles return at once. A group is a slot for
`lora.delta` and a (slot, local expert) pair for `lora.experts`; rows of slot -1 (the base model)
join no group and get exactly zero.

  shrink: program (tile) gathers its BLOCK_T rows of x, h = (x A_g^T) * scale of the group's
          slot, [BLOCK_T, R] in fp32 (R <= 32 padded to a power of two >= 16 for tl.dot);
  expand: program (tile, out block) out[rows, n] = h B_g[n]^T, fp32 (IEEE products).

bf16 / fp16 activations with adapters of the same dtype multiply on the tensor cores with fp32
accumulation (the reference upcasts: bf16 products are exact in fp32, so only the summation
order differs); other inputs in fp32 IEEE. float64 goes to the reference op.

`lora_experts_forward`: the base experts' two tensor-core launches (`moe_mxfp4.tiled_experts`,
tokens grouped by expert) with each (token, choice)'s adapter rows added inside them: the gate /
up delta (grouped shrink / expand of x by (slot, expert)) before the activation, the down delta
(of the activation rows) before the routing weight. Dense (non-MXFP4) experts and shapes the
MXFP4 kernels do not cover go to the reference op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3 import reference as ref

from . import interpreted
from .moe_mxfp4 import _routed_choices, covers, launch_options, tiled_experts
from .moe_mxfp4_common import expert_tiles, pairs_per_local_expert

BLOCK_T = 16          # rows per tile (tl.dot's smallest M)
MAX_RANK = 64


def group_tiles(groups: torch.Tensor, num_groups: int, block_t: int = BLOCK_T):
    """Rows grouped by `groups` [N] int64 (num_groups: no group): (order [N], starts [G + 1],
    counts [G + 1], tile_group, tile_start), int32, on the device (no host synchronisation)."""
    order = torch.argsort(groups, stable=True)
    counts = pairs_per_local_expert(groups, num_groups)
    counts[num_groups:].zero_()                                  # rows without a group: no tile reads them
    starts = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    tile_group, tile_start = expert_tiles(counts[:num_groups], block_t, max(groups.numel(), 1))
    return order.to(torch.int32), starts, counts, tile_group, tile_start


@triton.jit
def _shrink_kernel(x_ptr, src_ptr, a_ptr, scales_ptr, h_ptr, tile_group_ptr, tile_start_ptr, order_ptr, start_ptr,
                   count_ptr, s_x, s_ag, s_ar, s_h,
                   IN: tl.constexpr, R: tl.constexpr, PER_SLOT: tl.constexpr, NATIVE: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    g, row, mask_t, busy = _routed_choices(tile_group_ptr, tile_start_ptr, order_ptr, start_ptr, count_ptr, BLOCK_T)
    if not busy:
        return
    src = tl.load(src_ptr + row, mask=mask_t, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    mask_r = r < R
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, IN, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask_k = k < IN
        xt = tl.load(x_ptr + src[:, None] * s_x + k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
        at = tl.load(a_ptr + g * s_ag + r[None, :] * s_ar + k[:, None], mask=mask_r[None, :] & mask_k[:, None],
                     other=0.0)                                                            # [BLOCK_K, BLOCK_R]
        if NATIVE:
            acc = tl.dot(xt, at, acc)
        else:
            acc = tl.dot(xt.to(tl.float32), at.to(tl.float32), acc, input_precision="ieee")
    scale = tl.load(scales_ptr + g // PER_SLOT).to(tl.float32)
    tl.store(h_ptr + row[:, None] * s_h + r[None, :], acc * scale, mask=mask_t[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, out_ptr, tile_group_ptr, tile_start_ptr, order_ptr, start_ptr, count_ptr,
                   s_h, s_bg, s_bn, s_out,
                   OUT: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    g, row, mask_t, busy = _routed_choices(tile_group_ptr, tile_start_ptr, order_ptr, start_ptr, count_ptr, BLOCK_T)
    if not busy:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = n < OUT
    r = tl.arange(0, BLOCK_R)
    mask_r = r < R
    h = tl.load(h_ptr + row[:, None] * s_h + r[None, :], mask=mask_t[:, None] & mask_r[None, :], other=0.0)
    bt = tl.load(b_ptr + g * s_bg + n[None, :] * s_bn + r[:, None], mask=mask_r[:, None] & mask_n[None, :],
                 other=0.0).to(tl.float32)                                                 # [BLOCK_R, BLOCK_N]
    acc = tl.dot(h, bt, input_precision="ieee")
    tl.store(out_ptr + row[:, None] * s_out + n[None, :], acc, mask=mask_t[:, None] & mask_n[None, :])


def grouped_delta(x: torch.Tensor, src: torch.Tensor, groups: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  scales: torch.Tensor, *, per_slot: int = 1) -> torch.Tensor:
    """delta[i] = scales[g // per_slot] * B[g] (A[g] x[src[i]]) with g = groups[i] (no group:
    g == G, exactly zero). x [M, in]; src, groups [N] int64; a [G, R, in]; b [G, out, R];
    scales [S]. Returns [N, out] fp32."""
    n, (num_groups, rank, d_in), d_out = groups.numel(), a.shape, b.shape[1]
    out = torch.zeros(n, d_out, dtype=torch.float32, device=x.device)
    if n == 0:
        return out
    order, starts, counts, tile_group, tile_start = group_tiles(groups, num_groups)
    h = torch.empty(n, rank, dtype=torch.float32, device=x.device)          # rows without a group: never read
    block_r = max(16, triton.next_power_of_2(rank))
    native = x.dtype in (torch.bfloat16, torch.float16) and a.dtype == x.dtype
    a, b = a.contiguous(), b.contiguous()
    tiles = tile_group.numel()
    _shrink_kernel[(tiles,)](x, src, a, scales, h, tile_group, tile_start, order, starts, counts,
                             x.stride(0), a.stride(0), a.stride(1), h.stride(0), IN=d_in, R=rank, PER_SLOT=per_slot,
                             NATIVE=native, BLOCK_T=BLOCK_T, BLOCK_R=block_r,
                             BLOCK_K=min(64, max(16, triton.next_power_of_2(d_in))))
    block_n = min(64, max(16, triton.next_power_of_2(d_out)))
    _expand_kernel[(tiles, triton.cdiv(d_out, block_n))](h, b, out, tile_group, tile_start, order, starts, counts,
                                                         h.stride(0), b.stride(0), b.stride(1), out.stride(0),
                                                         OUT=d_out, R=rank, BLOCK_T=BLOCK_T, BLOCK_R=block_r,
                                                         BLOCK_N=block_n)
    return out


def _covered(*tensors) -> bool:
    return all(t.dtype in (torch.bfloat16, torch.float16, torch.float32) for t in tensors)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
               indices: torch.Tensor) -> torch.Tensor:
    """`LoRADelta` (the module docstring); float64, ranks over MAX_RANK and odd layouts go to
    the reference op."""
    if (x.dim() != 2 or a.dim() != 3 or b.dim() != 3 or not _covered(x, a, b) or a.shape[1] > MAX_RANK
            or x.stride(-1) != 1 or tuple(indices.shape) != (x.shape[0],)):
        return ref.lora_delta(x, a, b, scales, indices)
    s = a.shape[0]
    slots = indices.long()
    groups = torch.where((slots >= 0) & (slots < s), slots, s)
    rows = torch.arange(x.shape[0], device=x.device)
    return grouped_delta(x, rows, groups, a, b, scales.float())


def lora_experts_forward(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         indices: torch.Tensor, *, w13_lora: list, w2_lora: list, scales: torch.Tensor,
                         activation: str, beta: float | None = None, linear_beta: float | None = None,
                         expert_start: int = 0) -> torch.Tensor:
    """`LoRAExperts` on the MXFP4 experts' tiles (the module docstring)."""
    adapters = [t for _, a_, b_ in [*w13_lora, *w2_lora] for t in (a_, b_)]
    if (not covers(x, w13, w2, activation) or not _covered(*adapters)
            or any(a_.shape[2] > MAX_RANK for _, a_, _ in [*w13_lora, *w2_lora])):
        return ref.lora_experts_forward(x, w13, w2, topk_weights, topk_ids, indices, w13_lora=w13_lora,
                                        w2_lora=w2_lora, scales=scales, activation=activation, beta=beta,
                                        linear_beta=linear_beta, expert_start=expert_start)
    if activation == "situ" and beta is None:
        raise ValueError("lora_experts_forward: beta is required for activation='situ' (K3: 4.0)")
    t, l = x.shape
    if t == 0:
        return torch.zeros_like(x)
    e_local, two_i = w13.shape[0], w13.shape[1]
    k = topk_ids.shape[1]
    local = topk_ids.reshape(-1).long() - expert_start                                      # [T*k] pairs
    slot = indices.long().repeat_interleave(k)
    s = scales.shape[0]
    live = (local >= 0) & (local < e_local) & (slot >= 0) & (slot < s)
    groups = torch.where(live, slot * e_local + local, s * e_local)                          # (slot, expert)
    token = torch.arange(t * k, device=x.device) // k
    pair = torch.arange(t * k, device=x.device)
    sc = scales.float()

    def deltas(rows_of, src, targets, width):
        out = torch.zeros(t * k, width, dtype=torch.float32, device=x.device)
        for cut, a, b in targets:               # a [S, E, R, in], b [S, E, rows, R]
            out[:, cut] += grouped_delta(rows_of, src, groups, a.reshape(s * e_local, *a.shape[2:]),
                                         b.reshape(s * e_local, *b.shape[2:]), sc, per_slot=e_local)
        return out

    dot_scaled = x.dtype == torch.bfloat16 and x.is_cuda and not interpreted()
    chosen = launch_options(t, "dot_scaled" if dot_scaled else "decode")
    block_k = chosen["block_k"]
    while l % block_k or (two_i // 2) % block_k:
        block_k //= 2
    return tiled_experts(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta, linear_beta=linear_beta,
                         expert_start=expert_start, dot_scaled=dot_scaled, ieee=x.dtype == torch.float32,
                         block_t=chosen["block_t"], block_n=chosen["block_n"], block_k=block_k,
                         num_warps=chosen["num_warps"], stages=chosen.get("stages"),
                         delta13=deltas(x, token, w13_lora, two_i) if w13_lora else None,
                         delta2=(lambda act: deltas(act, pair, w2_lora, l)) if w2_lora else None)
