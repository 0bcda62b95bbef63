"""Fused KDA decode step in Triton: `KDAKernels.decode_step` (see k3.reference.kda_decode_step).

One program per (sequence, head) does the whole step in registers: the short conv of the
head's q, k and v channels from the cached window (sliding the window in place), SiLU, the
L2 norms, the decay gate and beta, the delta-rule update of the [K, V] fp32 state read from
and written back to its cache row, the read-out and the gated RMSNorm. The state is touched
once (read + write), which is the whole memory traffic that matters at decode. Rounding
follows the reference: conv outputs, normalised q and k, and o are rounded to the activation
dtype where the unfused path stores them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.platforms.torch_kernels import kda_decode as torch_decode

_ACTIVATIONS = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _conv_taps(qkv_ptr, w_ptr, win_ptr, n, row, fresh, c, s_qkv_n, s_win_r, s_win_c, s_win_t, W: tl.constexpr):
    """SiLU(causal conv) of channels c for the new token, reading the cached window only."""
    acc = tl.load(qkv_ptr + n * s_qkv_n + c).to(tl.float32) * tl.load(w_ptr + c * W + (W - 1)).to(tl.float32)
    base = win_ptr + row * s_win_r + c * s_win_c
    for t in tl.static_range(W - 1):
        x_t = tl.load(base + t * s_win_t)
        x_t = tl.where(fresh, tl.zeros_like(x_t), x_t)
        acc += x_t.to(tl.float32) * tl.load(w_ptr + c * W + t).to(tl.float32)
    return acc * tl.sigmoid(acc)


@triton.jit
def _slide_window(qkv_ptr, win_ptr, n, row, fresh, c, s_qkv_n, s_win_r, s_win_c, s_win_t, W: tl.constexpr):
    """Shift channels c's cached window by the new token (oldest dropped; zeros first when fresh).

    Triton may replicate a channel over several threads, so every tap is read before any
    thread writes (the barrier): reading and shifting in one pass races on the GPU (a lagging
    warp reads a tap another warp already overwrote) although the interpreter, being
    sequential, never shows it. Conv widths 2 to 4 (K3 and Kimi-Linear: 4).
    """
    x_new = tl.load(qkv_ptr + n * s_qkv_n + c).to(win_ptr.dtype.element_ty)
    base = win_ptr + row * s_win_r + c * s_win_c
    if W >= 3:
        x1 = tl.load(base + s_win_t)
        x1 = tl.where(fresh, tl.zeros_like(x1), x1)
    if W >= 4:
        x2 = tl.load(base + 2 * s_win_t)
        x2 = tl.where(fresh, tl.zeros_like(x2), x2)
    tl.debug_barrier()
    if W == 2:
        tl.store(base, x_new)
    if W == 3:
        tl.store(base, x1)
        tl.store(base + s_win_t, x_new)
    if W == 4:
        tl.store(base, x1)
        tl.store(base + s_win_t, x2)
        tl.store(base + 2 * s_win_t, x_new)


@triton.jit
def _conv_step(qkv_ptr, w_ptr, win_ptr, n, row, fresh, c, s_qkv_n, s_win_r, s_win_c, s_win_t, W: tl.constexpr):
    """SiLU(causal conv) of channels c for the new token, then the window slid in place."""
    y = _conv_taps(qkv_ptr, w_ptr, win_ptr, n, row, fresh, c, s_qkv_n, s_win_r, s_win_c, s_win_t, W)
    _slide_window(qkv_ptr, win_ptr, n, row, fresh, c, s_qkv_n, s_win_r, s_win_c, s_win_t, W)
    return y


@triton.jit
def _kda_decode_step_kernel(
    qkv_ptr, w_ptr, f_ptr, a_log_ptr, dt_bias_ptr, b_ptr, gate_ptr, norm_w_ptr,
    rec_ptr, win_ptr, idx_ptr, fresh_ptr, o_ptr,
    s_qkv_n, s_f_n, s_f_h, s_b_n, s_gate_n, s_gate_h, s_o_n, s_o_h,
    s_rec_r, s_rec_h, s_rec_k, s_rec_v, s_win_r, s_win_c, s_win_t,
    scale, lower_bound, norm_eps, l2_eps,
    H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, SOFTPLUS_GATE: tl.constexpr, STATE_FIRST: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    n = pid // H
    h = pid % H
    row = tl.load(idx_ptr + n).to(tl.int64)
    fresh = tl.load(fresh_ptr + n) != 0
    act = o_ptr.dtype.element_ty
    offs = tl.arange(0, K)
    P = H * K
    s_ptrs = rec_ptr + row * s_rec_r + h * s_rec_h + offs[:, None] * s_rec_k + offs[None, :] * s_rec_v
    if STATE_FIRST and BLOCK_V == K:        # the 4*K*V-byte row load is in flight during the conv
        S = tl.load(s_ptrs)

    # short conv + SiLU, rounded to the activation dtype (short_conv returns it)
    q = _conv_step(qkv_ptr, w_ptr, win_ptr, n, row, fresh, h * K + offs, s_qkv_n, s_win_r, s_win_c, s_win_t, W)
    k = _conv_step(qkv_ptr, w_ptr, win_ptr, n, row, fresh, P + h * K + offs, s_qkv_n, s_win_r, s_win_c, s_win_t, W)
    q = q.to(act).to(tl.float32)
    k = k.to(act).to(tl.float32)
    # L2 norms (eps inside the sqrt), rounded like l2_norm's output
    q = (q * tl.rsqrt(tl.sum(q * q, 0) + l2_eps)).to(act).to(tl.float32) * scale
    k = (k * tl.rsqrt(tl.sum(k * k, 0) + l2_eps)).to(act).to(tl.float32)

    # decay gate and beta, in fp32
    x = tl.load(f_ptr + n * s_f_n + h * s_f_h + offs).to(tl.float32) + tl.load(dt_bias_ptr + h * K + offs)
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    if SOFTPLUS_GATE:
        g = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    else:
        g = lower_bound * tl.sigmoid(a * x)
    beta = tl.sigmoid(tl.load(b_ptr + n * s_b_n + h).to(tl.float32))
    decay = tl.exp(g)
    c_v = 2 * P + h * K                                                        # first v channel
    o_row = o_ptr + n * s_o_n + h * s_o_h

    if BLOCK_V == K:
        # the whole [K, V] state row at once
        v = _conv_step(qkv_ptr, w_ptr, win_ptr, n, row, fresh, c_v + offs, s_qkv_n, s_win_r, s_win_c, s_win_t, W)
        v = v.to(act).to(tl.float32)
        if not STATE_FIRST:
            S = tl.load(s_ptrs)
        S = tl.where(fresh, tl.zeros_like(S), S)
        S = S * decay[:, None]
        u = beta * (v - tl.sum(S * k[:, None], 0))                           # [V]
        S = S + k[:, None] * u[None, :]
        tl.debug_barrier()                  # every replica has read the row before it is written
        tl.store(s_ptrs, S)
        o = tl.sum(S * q[:, None], 0).to(act).to(tl.float32)                  # [V]
        o_sumsq = tl.sum(o * o, 0)
    else:
        # V in blocks of BLOCK_V columns: a [K, BLOCK_V] tile live at a time (the whole row
        # does not fit in registers at K = V = 128); each block's v channels are convolved
        # from the window without sliding it, and the raw o is stored, normalised below
        cols = tl.arange(0, BLOCK_V)
        o_sumsq = 0.0
        for v0 in tl.static_range(0, K, BLOCK_V):
            v = _conv_taps(qkv_ptr, w_ptr, win_ptr, n, row, fresh, c_v + v0 + cols, s_qkv_n, s_win_r, s_win_c,
                           s_win_t, W).to(act).to(tl.float32)
            tile = rec_ptr + row * s_rec_r + h * s_rec_h + offs[:, None] * s_rec_k + (v0 + cols)[None, :] * s_rec_v
            S = tl.load(tile)
            S = tl.where(fresh, tl.zeros_like(S), S)
            S = S * decay[:, None]
            u = beta * (v - tl.sum(S * k[:, None], 0))                       # [BLOCK_V]
            S = S + k[:, None] * u[None, :]
            tl.debug_barrier()
            tl.store(tile, S)
            o_blk = tl.sum(S * q[:, None], 0).to(act)
            tl.store(o_row + v0 + cols, o_blk)
            o_blk = o_blk.to(tl.float32)
            o_sumsq += tl.sum(o_blk * o_blk, 0)
        _slide_window(qkv_ptr, win_ptr, n, row, fresh, c_v + offs, s_qkv_n, s_win_r, s_win_c, s_win_t, W)
        tl.debug_barrier()                  # the raw o blocks other threads stored
        o = tl.load(o_row + offs).to(tl.float32)

    # gated RMSNorm (sigmoid gate), cast once
    gate = tl.load(gate_ptr + n * s_gate_n + h * s_gate_h + offs).to(tl.float32)
    y = o * tl.rsqrt(o_sumsq / K + norm_eps) * tl.load(norm_w_ptr + offs).to(tl.float32) * tl.sigmoid(gate)
    tl.debug_barrier()                      # the raw o is read by every thread before it is overwritten
    tl.store(o_row + offs, y.to(act))


def covers(qkv, conv_weight, f, b, recurrent, conv_state) -> bool:
    """The inputs this kernel computes; anything else goes to the reference op."""
    n, h, k = f.shape
    return (qkv.dtype in _ACTIVATIONS and recurrent.dtype == torch.float32 and k & (k - 1) == 0 and k >= 16
            and tuple(recurrent.shape[1:]) == (h, k, k) and conv_weight.is_contiguous()
            and conv_weight.shape == (3 * h * k, conv_weight.shape[1]) and 2 <= conv_weight.shape[1] <= 4
            and qkv.stride(-1) == 1 and f.stride(-1) == 1 and b.stride(-1) == 1 and conv_state.dtype == qkv.dtype)


def kda_decode_step(qkv, conv_weight, f, A_log, dt_bias, b, out_gate, o_norm_weight, recurrent, conv_state,
                    state_indices, fresh, *, lower_bound, norm_eps, l2_eps=1e-6, scale=None, num_warps=None,
                    state_first=None, block_v=None):
    """`k3.reference.kda_decode_step` as one Triton kernel (same signature and contract).

    num_warps, state_first: launch options for benchmarks. Defaults, measured fastest on an H200
    (BENCHMARKS.md): 4 warps; the state row loaded before the conv when V is contiguous in it
    ("hkv" rows, 4-7% faster at N >= 64), after it otherwise ("hvk", 7-11% faster).
    block_v: state columns per step (default K: the whole row; a divisor of K processes the row
    in [K, block_v] tiles, which ptxas compiles without spills at K = 128)."""
    if not covers(qkv, conv_weight, f, b, recurrent, conv_state):
        return torch_decode.kda_decode_step(qkv, conv_weight, f, A_log, dt_bias, b, out_gate, o_norm_weight, recurrent,
                                   conv_state, state_indices, fresh, lower_bound=lower_bound, norm_eps=norm_eps,
                                   l2_eps=l2_eps, scale=scale)
    n, h, k = f.shape
    out_gate = out_gate.reshape(n, h, k)
    if out_gate.stride(-1) != 1:
        out_gate = out_gate.contiguous()
    o = torch.empty((n, h, k), dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return o
    _kda_decode_step_kernel[(n * h,)](
        qkv, conv_weight, f, A_log.reshape(h).float(), dt_bias.reshape(h * k).float(), b, out_gate, o_norm_weight,
        recurrent, conv_state, state_indices, fresh.view(torch.uint8) if fresh.dtype == torch.bool else fresh, o,
        qkv.stride(0), f.stride(0), f.stride(1), b.stride(0), out_gate.stride(0), out_gate.stride(1),
        o.stride(0), o.stride(1), *recurrent.stride(), *conv_state.stride(),
        k ** -0.5 if scale is None else scale, 0.0 if lower_bound is None else lower_bound, norm_eps, l2_eps,
        H=h, K=k, W=conv_weight.shape[1], SOFTPLUS_GATE=lower_bound is None, STATE_FIRST=recurrent.stride(-1) == 1 if state_first is None else state_first,
        BLOCK_V=k if block_v is None else block_v,
        num_warps=num_warps or 4,
    )
    return o
