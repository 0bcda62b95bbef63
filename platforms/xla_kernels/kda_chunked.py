"""KDA chunked prefill for XLA: `KDAKernels.chunked` as a fixed-chunk scan (issue 24).

`k3.plugin.kernels.KDAChunked` is the contract and `k3.reference.kda_chunked` its oracle. The
reference platform's kernels walk the chunks of each sequence in Python, cut where the host
read of `cu_seqlens` and the checkpoint offsets says, and solve with
`torch.linalg.solve_triangular` (a CPU fallback on torch-xla 2.9). Here every shape is static:

- Layout. Tokens are scattered into a grid of chunks `[L, R, C]` (C = 16..64 tokens, fixed by the
  shapes). Without `cu_seqlens` each of the B sequences is a lane (L = B, R = ceil(T / C)); with
  it the sequences follow each other in one lane (L = 1), sequence n taking ceil(len_n / C)
  chunks from its own start, R = ceil(T / C) + N (enough for any lengths). The chunk of every
  token comes from device arithmetic on `cu_seqlens` (`varlen.token_sequences`); unused grid
  positions hold zeros (k = v = 0, no decay, beta = 0: they change nothing).
- Phase 1, every chunk at once: the decay-weighted products of the WY/UT form (the diagonal
  blocks with exact pairwise decays, `torch_kernels.kda_chunked_blocked.diagonal_blocks_torch`;
  the blocks below scaled to the block's end so that nothing overflows) and the unit
  lower-triangular solve by block forward substitution (`triangular.unit_lower_solve`).
- Phase 2, the state recurrence over the R chunk steps (`scan.scan`: torch-xla's scan, one body
  lowered once). A chunk that starts a sequence starts from its initial state (segment flags on
  the device, no Python branch); the step that ends a sequence writes its final state.
  Checkpoints (any offset, not only chunk ends) are the chunk's start state advanced over the
  first offset tokens in closed form, `exp(G_o) S + sum_{t<o} exp(G_o - G_t) k_t u_t^T`, kept
  in the carry where the offset falls in the step's chunk.

fp32 throughout (fp64 for float64 inputs); outputs in the contract's dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3.dtypes import compute_dtype
from k3.platforms.torch_kernels.kda_chunked_blocked import diagonal_blocks_torch
from k3.plugin.kernels import KDAChunkedOut

from . import varlen
from .scan import scan
from .triangular import BLOCK, unit_lower_solve

MAX_CHUNK = 64


def chunk_for(T: int, chunk_size: int) -> int:
    """The static chunk: the hint rounded up to a multiple of 16, at most 64 and at most T
    rounded up (a short prefill does not pad to 64)."""
    hint = max(BLOCK, min(MAX_CHUNK, -(-int(chunk_size) // BLOCK) * BLOCK))
    return max(BLOCK, min(hint, -(-T // BLOCK) * BLOCK))


def _check(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size):
    op = "kda_chunked"
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be a positive int; got {chunk_size!r}")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"{op}: q and k must be [B, T, H, K]; got {tuple(q.shape)}, {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % H:
        raise ValueError(f"{op}: v must be [B, T, HV, V] with HV a multiple of H={H}; got {tuple(v.shape)}")
    HV, V = v.shape[2:]
    if tuple(g.shape) != (B, T, HV, K) or tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"{op}: g [B, T, HV, K] and beta [B, T, HV] expected; got {tuple(g.shape)}, "
                         f"{tuple(beta.shape)}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"{op}: with cu_seqlens, B must be 1; got {B}")
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, HV, K, V):
        raise ValueError(f"{op}: initial_state must be [N, HV, K, V] = [{N}, {HV}, {K}, {V}]; "
                         f"got {tuple(initial_state.shape)}")
    return B, T, H, HV, K, V, N


def _offsets(checkpoint_offsets, N: int, device) -> torch.Tensor:
    """The checkpoint offsets as [N, C'] int64 on the device (ints shared by every sequence, a
    [C'] tensor or a per-sequence [N, C'] tensor)."""
    if isinstance(checkpoint_offsets, torch.Tensor):
        if checkpoint_offsets.is_floating_point() or checkpoint_offsets.dim() not in (1, 2):
            raise ValueError(f"kda_chunked: checkpoint_offsets must be ints [C] or an integer tensor [N={N}, C]; "
                             f"got {checkpoint_offsets.dtype} {tuple(checkpoint_offsets.shape)}")
        offs = checkpoint_offsets.to(device=device, dtype=torch.long)
    else:
        offs = torch.tensor([int(o) for o in checkpoint_offsets], dtype=torch.long, device=device)
    if offs.dim() == 1:
        offs = offs[None].expand(N, offs.shape[0])
    if offs.shape[0] != N:
        raise ValueError(f"kda_chunked: checkpoint_offsets tensor must be [N={N}, C]; got {tuple(offs.shape)}")
    return offs


def _intra(q, k, v, g, beta):
    """Phase 1 for S chunks: q (scaled), k, g [S, HV, C, K]; v [S, HV, C, V]; beta [S, HV, C].
    Returns W, U, A_qk, q e^G, k e^(G_C - G), e^(G_C) of the WY/UT form and G."""
    S, HV, C, K = q.shape
    G = g.cumsum(2)
    A_kk = q.new_zeros(S, HV, C, C)
    A_qk = q.new_zeros(S, HV, C, C)
    diagonal_blocks_torch(q, k, G, A_kk, A_qk, block=BLOCK)
    for b0 in range(0, C - BLOCK, BLOCK):               # the rows below each block, both sides scaled to its end
        jb = slice(b0, b0 + BLOCK)
        Gr = G[:, :, b0 + BLOCK - 1: b0 + BLOCK]                                  # [S, HV, 1, K]
        right = (k[:, :, jb] * torch.exp(Gr - G[:, :, jb])).transpose(-1, -2)     # [S, HV, K, 16], <= 1
        left = torch.exp(G[:, :, b0 + BLOCK:] - Gr)                               # [S, HV, rows, K], <= 1
        A_kk[:, :, b0 + BLOCK:, jb] = (k[:, :, b0 + BLOCK:] * left) @ right
        A_qk[:, :, b0 + BLOCK:, jb] = (q[:, :, b0 + BLOCK:] * left) @ right
    b = beta[..., None]                                                           # [S, HV, C, 1]
    eG = torch.exp(G)
    WU = unit_lower_solve(b * A_kk, b * torch.cat([eG * k, v], dim=-1))
    W, U = WU.split([K, v.shape[-1]], dim=-1)
    GC = G[:, :, -1:]
    return W, U, A_qk.tril(), q * eG, torch.exp(GC - G) * k, torch.exp(GC), G


def _step(carry, x):
    """One chunk step of phase 2 for every lane (the module docstring): module level and pure, so
    torch-xla's scan traces it once per shape."""
    S, finals, init_ = carry[:3]
    W_, U_, A_, qeG_, kdec_, eGC_, first_, last_, seq_, r = x[:10]
    S_in = torch.where(first_[:, None, None, None], init_.index_select(0, seq_), S)    # [L, HV, K, V]
    delta = U_ - W_ @ S_in                                                    # [L, HV, C, V]
    o = qeG_ @ S_in + A_ @ delta
    S_out = eGC_.transpose(-1, -2) * S_in + kdec_.transpose(-1, -2) @ delta
    finals = finals.index_copy(0, seq_, torch.where(last_[:, None, None, None], S_out,
                                                    finals.index_select(0, seq_)))
    out = (S_out, finals, init_)
    if len(carry) > 3:
        ck, = carry[3:]
        G_, k_, ck_step_, ck_len_, ck_lane_ = x[10:]
        Gj = G_.index_select(0, ck_lane_)                                     # [J, HV, C, K]
        at = (ck_len_ - 1).clamp(min=0)[:, None, None, None].expand(-1, Gj.shape[1], 1, Gj.shape[3])
        Go = Gj.gather(2, at)                                                 # [J, HV, 1, K]
        before = (torch.arange(Gj.shape[2], device=Gj.device)[None, :] < ck_len_[:, None])[:, None, :, None]
        dec = torch.where(before, torch.exp(torch.where(before, Go - Gj, 0.0)), 0.0) * k_.index_select(0, ck_lane_)
        Sj = Go.transpose(-1, -2).exp() * S_in.index_select(0, ck_lane_) + \
            dec.transpose(-1, -2) @ delta.index_select(0, ck_lane_)
        hit = ((ck_step_ == r) & (ck_len_ > 0))[:, None, None, None]
        out += (torch.where(hit, Sj, ck),)
    return out, o


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                scale: float | None = None, initial_state: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
                checkpoint_offsets: Sequence[int] | torch.Tensor | None = None) -> KDAChunkedOut:
    """`KDAChunked` as a fixed-chunk scan (the module docstring): no host read of `cu_seqlens`
    or of the checkpoint offsets, static shapes, no CPU fallback."""
    B, T, H, HV, K, V, N = _check(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size)
    dev, cd = q.device, compute_dtype(q, k, v, g, beta, initial_state)
    scale = K ** -0.5 if scale is None else scale
    C = chunk_for(T, chunk_size)
    rep = HV // H
    qf = q.to(cd).repeat_interleave(rep, dim=2) * scale                          # [B, T, HV, K]
    kf = k.to(cd).repeat_interleave(rep, dim=2)
    vf, gf, bf = v.to(cd), g.to(cd), beta.to(cd)[..., None]                      # bf [B, T, HV, 1]
    init = (torch.zeros(N, HV, K, V, dtype=cd, device=dev) if initial_state is None
            else initial_state.to(cd))
    steps = torch.arange(-(-T // C) + (0 if cu_seqlens is None else N), device=dev)    # [R]
    R = steps.shape[0]
    if cu_seqlens is None:                  # lane b = sequence b, chunk r its tokens r*C ..
        L = B
        pad = R * C - T

        def to_grid(x):                                                           # [B, T, HV, D] -> [B, R, C, HV, D]
            return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).view(B, R, C, *x.shape[2:])

        lane_seq = torch.arange(B, device=dev)[:, None].expand(B, R)             # [L, R]
        first, last = (steps == 0)[None].expand(B, R), (steps == R - 1)[None].expand(B, R)
        seq_start = torch.zeros(N, dtype=torch.long, device=dev)                  # first chunk of each sequence
        lane_of = torch.arange(N, device=dev)
    else:                                   # one lane: sequence n's chunks from starts[n] on
        L = 1
        seq, pos = varlen.token_sequences(cu_seqlens, T)
        nch = (varlen.lengths(cu_seqlens) + C - 1) // C                           # [N]
        ends = nch.cumsum(0)
        seq_start = ends - nch
        slot = seq_start.gather(0, seq.clamp(max=N - 1)) * C + pos                # grid position of each token
        slot = torch.where(seq < N, slot, torch.full_like(slot, R * C))           # tokens past the end: a dump row

        def to_grid(x):
            flat = x.new_zeros(R * C + 1, *x.shape[2:]).index_copy(0, slot, x[0])
            return flat[: R * C].view(1, R, C, *x.shape[2:])

        chunk_seq = (steps[:, None] >= ends[None, :]).sum(1)                      # [R], N past the last
        valid = chunk_seq < N
        cs = chunk_seq.clamp(max=N - 1)
        lane_seq = cs[None]
        first = (valid & (steps == seq_start.gather(0, cs)))[None]
        last = (valid & (steps == ends.gather(0, cs) - 1))[None]
        lane_of = torch.zeros(N, dtype=torch.long, device=dev)

    # phase 1: [L*R, HV, C, *]
    grid = [to_grid(x).flatten(0, 1).transpose(1, 2) for x in (qf, kf, vf, gf, bf)]
    W, U, A_qk, qeG, kdec, eGC, G = _intra(*grid[:4], grid[4][..., 0])
    kg = grid[1]

    def per_step(x):                                                              # [L*R, ...] -> [R, L, ...]
        return x.view(L, R, *x.shape[1:]).transpose(0, 1)

    xs = [per_step(x) for x in (W, U, A_qk, qeG, kdec, eGC)]
    xs += [first.T, last.T, lane_seq.T, steps]
    ckpt = checkpoint_offsets is not None
    if ckpt:
        offs = _offsets(checkpoint_offsets, N, dev)                               # [N, C']
        Cp = offs.shape[1]
        o_flat = offs.reshape(-1)                                                 # [J] in (n, c) order
        n_of = torch.arange(N, device=dev).repeat_interleave(Cp)
        in_seq = (o_flat - 1).clamp(min=0) // C                                   # chunk of the offset's last token
        ck_step = seq_start.gather(0, n_of) + in_seq
        ck_len = o_flat - in_seq * C                                              # tokens of that chunk before it
        ck_lane = lane_of.gather(0, n_of)
        xs += [per_step(G), per_step(kg)] + [m[None].expand(R, -1) for m in (ck_step, ck_len, ck_lane)]
    # the carry holds floats only (torch-xla's scan traces it for gradients): constants ride in xs
    carry = (init.new_zeros(L, HV, K, V), init.clone(), init)
    if ckpt:
        carry += (init.new_zeros(o_flat.shape[0], HV, K, V),)

    carry, o_steps = scan(_step, carry, tuple(xs))                                 # o_steps [R, L, HV, C, V]
    o_grid = o_steps.permute(1, 0, 3, 2, 4).reshape(L, R * C, HV, V)
    if cu_seqlens is None:
        o = o_grid[:, :T]
    else:
        o = torch.cat([o_grid[0], o_grid.new_zeros(1, HV, V)]).index_select(0, slot)[None]
    finals = carry[1]
    checkpoints: tuple[torch.Tensor, ...] = ()
    if ckpt:
        ck = torch.where((o_flat == 0)[:, None, None, None], init.index_select(0, n_of), carry[3])
        ck = ck.view(N, Cp, HV, K, V)
        checkpoints = tuple(ck[:, c] for c in range(Cp))
    return KDAChunkedOut(o.to(v.dtype), finals, checkpoints)
