"""One fused KDA decode step over the cache's state rows (the kernel contract of
`KDAKernels.decode_step`), composed from the reference ops so it is exactly the layer's
unfused decode path.

Per one-token sequence n and head h, reading state row r = state_indices[n] (zeros when
fresh[n]) and writing it back in place:
    y      = SiLU(short_conv(qkv[n], conv window of row r))         conv window slides in place
    q, k   = l2_norm(y_q), l2_norm(y_k);  v = y_v
    g      = kda_gate(f[n], A_log, dt_bias, lower_bound);  beta = sigmoid(b[n])
    S      = recurrent[r] * exp(g);  S += k (beta (v - S^T k))^T;  o = scale S^T q
    out[n] = gated_rms_norm(o, out_gate[n], o_norm_weight, norm_eps)
"""

from __future__ import annotations

import torch

from .conv import short_conv
from .kda import kda_recurrent
from .kda_gate import kda_gate
from .norms import gated_rms_norm, l2_norm


def kda_decode_step(
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    out_gate: torch.Tensor,
    o_norm_weight: torch.Tensor,
    recurrent: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    fresh: torch.Tensor,
    *,
    lower_bound: float | None,
    norm_eps: float,
    l2_eps: float = 1e-6,
    scale: float | None = None,
) -> torch.Tensor:
    """KDA decode for N one-token sequences, state read and written in the cache rows.

    qkv [N, 3*H*K] pre-conv q, k, v projections (activation dtype); conv_weight [3*H*K, W];
    f [N, H, K] raw decay logits; A_log [H]; dt_bias [H, K]; b [N, H] raw beta logits;
    out_gate [N, H, V] output-gate projection; o_norm_weight [V];
    recurrent [rows, H, K, V] fp32 state rows (any strides: a `KDAStateView.recurrent`, in
    either state layout); conv_state [rows, 3*H*K, W-1] pre-conv windows, oldest first;
    state_indices [N] int rows; fresh [N] bool (start from a zero state and window).
    lower_bound: K3's gate bound (-5.0), or None for Kimi-Linear's softplus gate.
    Returns o [N, H, V] in qkv's dtype (normalised and gated, ready for o_proj). No host
    synchronisation; rows not in state_indices are untouched.
    """
    n, h, k = f.shape
    rows = state_indices.long()
    conv_in = conv_state[rows].masked_fill(fresh[:, None, None], 0)                   # [N, 3HK, W-1]
    s0 = recurrent[rows].masked_fill(fresh[:, None, None, None], 0)                     # [N, H, K, V]
    conv = short_conv(qkv.unsqueeze(1), conv_weight, conv_state=conv_in)              # y [N, 1, 3HK]
    conv_state[rows] = conv.state
    yq, yk, v = conv.y.reshape(n, 3, h, k).unbind(1)                                         # [N, H, K] each
    q, kk = l2_norm(yq, l2_eps), l2_norm(yk, l2_eps)
    g = kda_gate(f, A_log, dt_bias, lower_bound=lower_bound)                           # [N, H, K] fp32
    beta = torch.sigmoid(b.to(g.dtype))                                                 # [N, H]
    out = kda_recurrent(q[:, None], kk[:, None], v[:, None], g[:, None], beta[:, None], scale=scale,
                        initial_state=s0)                                               # o [N, 1, H, V]
    recurrent[rows] = out.state.to(recurrent.dtype)
    return gated_rms_norm(out.o[:, 0], out_gate, o_norm_weight, norm_eps)
