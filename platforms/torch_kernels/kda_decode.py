"""One KDA decode step over the cache's state rows in torch: what the reference platform serves
as `kda.decode_step`, composed from the torch kernels this platform serves for the unfused path
(short_conv, recurrent), so a fused step equals the layer's unfused decode exactly.
`k3.plugin.kernels.KDADecodeStep` is the contract; `k3.reference.kda_decode_step` (the same
composition over the naive oracles) is its oracle.

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

from k3.reference import gated_rms_norm, kda_gate, l2_norm

from .kda_recurrent import kda_recurrent
from .short_conv import short_conv


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
    """`KDADecodeStep`: the module docstring."""
    n, h, k = f.shape
    rows = state_indices.long()
    # the gathers are copies: cleared in place (a pass over every state row saved at batch 64)
    conv_in = conv_state[rows].masked_fill_(fresh[:, None, None], 0)                  # [N, 3HK, W-1]
    s0 = recurrent[rows].masked_fill_(fresh[:, None, None, None], 0)                    # [N, H, K, V]
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
