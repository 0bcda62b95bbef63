"""Causal short convolution for prefill in Triton: `KDAKernels.short_conv` (see
k3.reference.short_conv for the contract).

One program per (block of tokens, block of channels) computes y for ragged sequences packed
along T: each tap reads the token W-1-j places back when it lies in the same sequence and the
cached window (`conv_state`) otherwise, then SiLU. The final windows and the checkpoint windows
are gathers of W-1 rows (the reference's `window`), done in torch. Which sequence a token
belongs to is found on the device (a comparison sum), so only the checkpoint offsets and
`cu_seqlens` are read on the host, as the reference does. float64 goes to the reference op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops_helpers import checkpoint_offsets_per_sequence, sequence_bounds
from k3.platforms.torch_kernels import short_conv as torch_conv
from k3.plugin.kernels import ShortConvOut


@triton.jit
def _short_conv_kernel(x_ptr, w_ptr, state_ptr, seq_ptr, pos_ptr, y_ptr, T, C,
                       s_xt, s_sn, s_sc, s_sw, s_yt,
                       W: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t = tok < T
    mask_c = ch < C
    mask = mask_t[:, None] & mask_c[None, :]
    seq = tl.load(seq_ptr + tok, mask=mask_t, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + tok, mask=mask_t, other=0)
    tok64 = tok.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        src = pos - (W - 1) + j                                   # position of the tap in its sequence
        in_seq = (src >= 0)[:, None]
        xv = tl.load(x_ptr + (tok64 - (W - 1) + j)[:, None] * s_xt + ch[None, :], mask=mask & in_seq, other=0.0)
        hv = tl.load(state_ptr + seq[:, None] * s_sn + ch[None, :] * s_sc + (W - 1 + src)[:, None] * s_sw,
                     mask=mask & (in_seq == 0), other=0.0)
        acc += (xv.to(tl.float32) + hv.to(tl.float32)) * tl.load(w_ptr + ch * W + j, mask=mask_c, other=0.0).to(
            tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + tok64[:, None] * s_yt + ch[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def _windows(x2d, hist, starts, ends_local, width):
    """[N, C, W-1]: the W-1 inputs before local token ends_local[n] of each sequence (history
    rows before its start come from hist [N, W-1, C])."""
    n = hist.shape[0]
    i = ends_local[:, None] + torch.arange(width - 1, device=x2d.device)                 # [N, W-1]
    from_hist = i < width - 1
    rows = torch.arange(n, device=x2d.device)[:, None]
    h = hist[rows, i.clamp(max=width - 2)]                                                # [N, W-1, C]
    xs = x2d[(starts[:, None] + i - (width - 1)).clamp(min=0)]                            # [N, W-1, C]
    return torch.where(from_hist[..., None], h, xs).transpose(1, 2)


def short_conv(x, weight, *, conv_state=None, cu_seqlens=None, activation="silu", checkpoint_offsets=None):
    """`k3.reference.short_conv` with the convolution in Triton (same signature and contract)."""
    if x.dtype == torch.float64 or weight.dtype == torch.float64 or (
            conv_state is not None and conv_state.dtype == torch.float64) or activation not in ("silu", None):
        return torch_conv.short_conv(x, weight, conv_state=conv_state, cu_seqlens=cu_seqlens, activation=activation,
                              checkpoint_offsets=checkpoint_offsets)
    b, t, c = x.shape
    w = weight[:, 0] if weight.dim() == 3 else weight
    if w.dim() != 2 or w.shape[0] != c:
        return torch_conv.short_conv(x, weight, conv_state=conv_state, cu_seqlens=cu_seqlens, activation=activation,
                              checkpoint_offsets=checkpoint_offsets)
    width = w.shape[1]
    bounds = sequence_bounds(cu_seqlens, b, t, "short_conv")
    n = len(bounds)
    if conv_state is not None and tuple(conv_state.shape) != (n, c, width - 1):
        raise ValueError(f"short_conv: conv_state must be [N, C, W-1] = [{n}, {c}, {width - 1}]; "
                         f"got {tuple(conv_state.shape)}")
    state = conv_state if conv_state is not None else x.new_zeros(n, c, max(width - 1, 1))
    x2d = x.reshape(b * t, c)
    starts = torch.tensor([s for s, _ in bounds], device=x.device)
    lengths = torch.tensor([e - s for s, e in bounds], device=x.device)
    tok = torch.arange(b * t, device=x.device)
    ends = starts + lengths
    seq = (ends[None, :] <= tok[:, None]).sum(-1).clamp(max=n - 1).to(torch.int32)       # [T]
    pos = (tok - starts[seq.long()]).to(torch.int32)
    y = torch.empty_like(x2d)
    w = w.contiguous()
    if b * t:
        block_t, block_c = 16, 64
        _short_conv_kernel[(triton.cdiv(b * t, block_t), triton.cdiv(c, block_c))](
            x2d, w, state, seq, pos, y, b * t, c, x2d.stride(0), *state.stride(), y.stride(0),
            W=width, SILU=activation == "silu", BLOCK_T=block_t, BLOCK_C=block_c)
    hist = state.transpose(1, 2).to(x.dtype)                                              # [N, W-1, C]
    final = x.new_zeros(n, c, 0) if width == 1 else _windows(x2d, hist, starts, lengths, width).contiguous()
    if checkpoint_offsets is None:
        return ShortConvOut(y.view(b, t, c), final)
    offsets = checkpoint_offsets_per_sequence(checkpoint_offsets, lengths.tolist(), "short_conv")
    checkpoints = []
    for col in range(len(offsets[0]) if offsets else 0):
        at = torch.tensor([row[col] for row in offsets], device=x.device)
        checkpoints.append(x.new_zeros(n, c, 0) if width == 1 else _windows(x2d, hist, starts, at, width).contiguous())
    return ShortConvOut(y.view(b, t, c), final, tuple(checkpoints))
