"""Token-serial KDA in Triton: `KDAKernels.recurrent` (see k3.reference.kda_recurrent for the
contract), the op behind speculative verify steps (k + 1 tokens per sequence, the state after
every token kept for rollback, and the delta-rule corrections for "recover" rollback) and short
ragged batches.

One program per (sequence, value head, BLOCK_V columns of the state): it holds its
[K, BLOCK_V] slice of the fp32 state in registers and walks the sequence's tokens in order, per
token

    S <- S * exp(g)[:, None]            (decay along the key axis)
    u  = beta * (v - S^T k)             (the delta-rule correction, [BLOCK_V])
    S <- S + k u^T
    o  = S^T (q * scale)                (read after the update)

writing o, and when asked the state after the token and u. q and k of a value head come from
key head h // (HV / H). The tokens of sequence n are rows cu_seqlens[n] .. cu_seqlens[n+1] of
the packed batch, and the program loops over exactly those, reading the bounds on the device
(no host synchronisation, capturable in a CUDA graph). Inputs in bf16,
fp16 or fp32 are computed in fp32; float64 and head sizes that are not powers of two go to the
reference op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.platforms.torch_kernels import kda_recurrent as torch_recurrent
from k3.plugin.kernels import KDARecurrentOut

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _kda_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, cu_ptr, o_ptr, ht_ptr, states_ptr, u_ptr,
    T_EACH, scale, HV, REP,
    K: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr,
    VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_STATES: tl.constexpr, STORE_U: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    h = hv // REP                                                      # the q / k head
    kk = tl.arange(0, K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    if VARLEN:
        bos = tl.load(cu_ptr + n).to(tl.int64)
        eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    else:
        bos = n * T_EACH
        eos = bos + T_EACH
    # state rows [N, HV, K, V] and per-position states [B*T, HV, K, V], contiguous
    tile = kk[:, None] * V + vv[None, :]                               # [K, BLOCK_V]
    if HAS_H0:
        S = tl.load(h0_ptr + (n * HV + hv) * K * V + tile).to(tl.float32)
    else:
        S = tl.zeros((K, BLOCK_V), dtype=tl.float32)
    # a while loop over the sequence's own tokens: the Triton interpreter cannot take a
    # runtime bound in range(), and a device-side length needs no host read
    t = bos
    while t < eos:
        qk_row = (t * (HV // REP) + h) * K
        q = tl.load(q_ptr + qk_row + kk).to(tl.float32) * scale
        k = tl.load(k_ptr + qk_row + kk).to(tl.float32)
        g = tl.load(g_ptr + (t * HV + hv) * K + kk).to(tl.float32)
        v = tl.load(v_ptr + (t * HV + hv) * V + vv).to(tl.float32)
        beta = tl.load(beta_ptr + t * HV + hv).to(tl.float32)
        S = S * tl.exp(g)[:, None]
        u = beta * (v - tl.sum(S * k[:, None], 0))                 # [BLOCK_V]
        S = S + k[:, None] * u[None, :]
        o = tl.sum(S * q[:, None], 0)
        tl.store(o_ptr + (t * HV + hv) * V + vv, o.to(o_ptr.dtype.element_ty))
        if STORE_STATES:
            tl.store(states_ptr + (t * HV + hv) * K * V + tile, S)
        if STORE_U:
            tl.store(u_ptr + (t * HV + hv) * V + vv, u)
        t += 1
    tl.store(ht_ptr + (n * HV + hv) * K * V + tile, S)


def covers(q, k, v, g, beta, initial_state) -> bool:
    """The inputs this kernel computes; anything else goes to the reference op (which also
    raises the contract's errors for malformed shapes)."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        return False
    b, t, h, kd = q.shape
    hv, vd = v.shape[2:]
    tensors = (q, k, v, g, beta) + ((initial_state,) if initial_state is not None else ())
    return (all(x.dtype in _DTYPES for x in tensors) and hv % h == 0 and tuple(g.shape) == (b, t, hv, kd)
            and tuple(beta.shape) == (b, t, hv) and kd >= 16 and vd >= 16
            and kd & (kd - 1) == 0 and vd & (vd - 1) == 0)


def kda_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                  output_per_position_states=False, output_corrections=False, block_v=32):
    """`k3.reference.kda_recurrent` in Triton (same signature, outputs and dtypes).

    block_v: state columns per program (a launch option for benchmarks).
    """
    if not covers(q, k, v, g, beta, initial_state):
        return torch_recurrent.kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                 output_per_position_states=output_per_position_states,
                                 output_corrections=output_corrections)
    b, t, h, kd = q.shape
    hv, vd = v.shape[2:]
    if cu_seqlens is not None and b != 1:
        raise ValueError(f"kda_recurrent: with cu_seqlens the batch must be packed as B = 1; got B = {b}")
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is not None and tuple(initial_state.shape) != (n, hv, kd, vd):
        raise ValueError(f"kda_recurrent: initial_state must be [N, HV, K, V] = [{n}, {hv}, {kd}, {vd}]; "
                         f"got {tuple(initial_state.shape)}")
    dev = q.device
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else q      # placeholder when absent
    o = torch.empty(b, t, hv, vd, dtype=v.dtype, device=dev)
    ht = torch.empty(n, hv, kd, vd, dtype=torch.float32, device=dev)
    states = torch.empty(b, t, hv, kd, vd, dtype=torch.float32, device=dev) if output_per_position_states else ht
    u = torch.empty(b, t, hv, vd, dtype=torch.float32, device=dev) if output_corrections else ht
    block_v = min(block_v, vd)
    if n:
        _kda_recurrent_kernel[(n, hv, triton.cdiv(vd, block_v))](
            q, k, v, g, beta, h0, cu_seqlens if cu_seqlens is not None else q, o, ht, states, u,
            t, float(kd ** -0.5 if scale is None else scale), hv, hv // h,
            K=kd, V=vd, BLOCK_V=block_v, VARLEN=cu_seqlens is not None, HAS_H0=initial_state is not None,
            STORE_STATES=output_per_position_states, STORE_U=output_corrections,
        )
    return KDARecurrentOut(o, ht, states=states if output_per_position_states else None,
                           corrections=u if output_corrections else None)
