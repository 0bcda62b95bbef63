"""KDA's speculative rollback ("recover") in closed form, without host synchronisation: what
the reference platform serves as `kda.rebuild_state`. `k3.plugin.kernels.KDARebuildState` is
the contract; `k3.reference.kda_rebuild_state` replays the kept tokens one by one as its oracle.

    S_n = diag(e^{G_n}) S_0 + sum_{t < n} diag(e^{G_n - G_t}) k_t u_t^T,   G_t = g_1 + ... + g_t
"""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype, upcast


def kda_rebuild_state(
    initial_state: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    num_kept: torch.Tensor,
) -> torch.Tensor:
    """`KDARebuildState` in closed form (the module docstring): every kept position at once,
    dropped positions selected away (never multiplied by 0: they may hold NaN)."""
    if k.dim() != 4 or g.shape != k.shape or u.shape[:3] != k.shape[:3] or initial_state.dim() != 4:
        raise ValueError(f"kda_rebuild_state: k, g [N, L, HV, K], u [N, L, HV, V] and initial_state "
                         f"[N, HV, K, V] expected, got {tuple(k.shape)}, {tuple(g.shape)}, {tuple(u.shape)}, "
                         f"{tuple(initial_state.shape)}")
    cd = compute_dtype(initial_state, k, g, u)
    s0, kk, gg, uu = (upcast(x, cd) for x in (initial_state, k, g, u))
    n, length = k.shape[:2]
    G = gg.cumsum(1)                                                     # [N, L, HV, K] inclusive
    kept = num_kept.to(k.device).long()
    last = (kept - 1).clamp(min=0)
    Gn = G.gather(1, last[:, None, None, None].expand(n, 1, *G.shape[2:]))[:, 0]     # [N, HV, K]
    Gn = torch.where((kept > 0)[:, None, None], Gn, torch.zeros_like(Gn))
    live = (torch.arange(length, device=k.device)[None, :] < kept[:, None])[:, :, None, None]   # [N, L, 1, 1]
    # dropped positions may hold anything (unwritten records are NaN): select, never multiply by 0
    decay = torch.where(live, torch.exp(torch.where(live, Gn[:, None] - G, 0.0)), 0.0)        # [N, L, HV, K]
    kk, uu = torch.where(live, kk, 0.0), torch.where(live, uu, 0.0)
    return torch.exp(Gn)[..., None] * s0 + torch.einsum("nlhk,nlhv->nhkv", decay * kk, uu)
