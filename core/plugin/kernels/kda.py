"""KDA (Kimi Delta Attention) kernel entries: `KDAKernels`.

Layout (fla-core's): q, k `[B, T, H, K]` (already L2-normalised; `scale` is applied inside),
v `[B, T, HV, V]` with HV a multiple of H (value head j reads q/k head j // (HV / H)),
g `[B, T, HV, K]` log decay (<= 0, from `gate`), beta `[B, T, HV]` (after the sigmoid), states
the canonical `[N, HV, K, V]` (K-major) in the compute dtype (fp32; fp64 for float64 inputs)
whatever the platform's `k3_kda_state_layout` says. Prefill packs N sequences along T
(`cu_seqlens` `[N+1]`, B = 1, read on the host); decode runs N one-token sequences as B = N,
T = 1 without `cu_seqlens`, and must then not synchronise with the host. Per token, with the
state S `[K, V]` of a value head:

    S = S * exp(g)[:, None];   u = beta * (v - S^T k);   S = S + k u^T;   o = scale * S^T q

(the output is read after the update). Outputs are new tensors: the model writes them into its
cache rows, except `decode_step`, the one entry that updates state rows in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


@dataclass(frozen=True)
class ShortConvOut:
    """y `[B, T, C]` x.dtype; state `[N, C, W-1]` x.dtype, each sequence's last W-1 pre-conv
    inputs after it; checkpoints: one `[N, C, W-1]` window per checkpoint offset, in the order
    asked, empty without `checkpoint_offsets`."""

    y: Tensor
    state: Tensor
    checkpoints: tuple[Tensor, ...] = ()


@dataclass(frozen=True)
class KDAChunkedOut:
    """o `[B, T, HV, V]` v.dtype; state `[N, HV, K, V]` compute dtype, the final state of each
    sequence; checkpoints: one `[N, HV, K, V]` state (compute dtype) per checkpoint offset, the
    state after that many tokens of each sequence (offset 0 = the initial state), in the order
    asked, empty without `checkpoint_offsets`."""

    o: Tensor
    state: Tensor
    checkpoints: tuple[Tensor, ...] = ()


@dataclass(frozen=True)
class KDARecurrentOut:
    """o `[B, T, HV, V]` v.dtype; state `[N, HV, K, V]` compute dtype (final); states
    `[B, T, HV, K, V]` compute dtype, the state after each token (only with
    `output_per_position_states`, else None); corrections `[B, T, HV, V]` compute dtype, each
    token's beta-scaled delta-rule correction u (only with `output_corrections`, else None),
    from which `rebuild_state` rebuilds any prefix's state."""

    o: Tensor
    state: Tensor
    states: Tensor | None = None
    corrections: Tensor | None = None


class KDAGate(Protocol):
    """`kda.gate`: the per-channel log decay g <= 0 from the raw decay logits.

    f `[..., HV, K]` raw logits; A_log `[HV]` (legacy `[1, 1, HV, 1]` accepted); dt_bias
    `[HV*K]`, `[HV, K]` or None. With a = exp(A_log[h]) and x = f + dt_bias: K3 (lower_bound in
    [-5, 0), -5.0) g = lower_bound * sigmoid(a x); Kimi-Linear (lower_bound None)
    g = -a * softplus(x) (threshold 20). Returns g `[..., HV, K]` in the compute dtype (fp32,
    fp64 for float64), not cast back: g feeds the recurrence.
    """

    def __call__(self, f: Tensor, A_log: Tensor, dt_bias: Tensor | None = None, *,
                 lower_bound: float | None = None) -> Tensor: ...


class ShortConv(Protocol):
    """`kda.short_conv`: depthwise causal conv with cached history,
    y_t[c] = act(sum_j weight[c, j] x_{t-W+1+j}[c]) (tap W-1 is the current token).

    x `[B, T, C]` (with `cu_seqlens` `[N+1]`: B = 1; else N = B); weight `[C, W]` or `[C, 1, W]`
    (Conv1d layout), no bias; conv_state `[N, C, W-1]`: the last W-1 pre-conv inputs before each
    sequence, oldest first (None: zeros); activation "silu" or None; checkpoint_offsets: ints
    `[C']` shared by every sequence or an integer tensor `[N, C']`, each in [0, len_n]:
    checkpoint c of sequence n is the window after that many of its tokens (0 = conv_state).
    Products and sums in the compute dtype. A sequence shorter than W-1 keeps the newest part of
    its old state. Returns `ShortConvOut`.
    """

    def __call__(self, x: Tensor, weight: Tensor, *, conv_state: Tensor | None = None,
                 cu_seqlens: Tensor | None = None, activation: str | None = "silu",
                 checkpoint_offsets: Sequence[int] | Tensor | None = None) -> ShortConvOut: ...


class KDAChunked(Protocol):
    """`kda.chunked`: KDA prefill over whole sequences (the recurrence in the module docstring,
    computed chunk-wise or any way that equals it up to rounding).

    q, k, v, g, beta as the module docstring; scale: default K^-0.5; initial_state
    `[N, HV, K, V]` or None (zeros); cu_seqlens `[N+1]` (B = 1) or None (N = B); chunk_size: any
    positive int (a kernel's tiling hint: the result does not depend on it beyond rounding);
    checkpoint_offsets: ints `[C]` shared by every sequence or an integer tensor `[N, C]`, each
    in [0, len_n], any offset (not only chunk multiples): the states after that many tokens,
    emitted in the same pass (prefix caching). Returns `KDAChunkedOut`.
    """

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                 scale: float | None = None, initial_state: Tensor | None = None,
                 cu_seqlens: Tensor | None = None, chunk_size: int = 64,
                 checkpoint_offsets: Sequence[int] | Tensor | None = None) -> KDAChunkedOut: ...


class KDARecurrent(Protocol):
    """`kda.recurrent`: the token-serial recurrence (decode with checkpoints, speculative verify).

    Arguments as `KDAChunked` without the chunking; without `cu_seqlens` no host
    synchronisation. output_per_position_states / output_corrections ask for the optional
    fields of `KDARecurrentOut` (the verify pass needs both).
    """

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                 scale: float | None = None, initial_state: Tensor | None = None,
                 cu_seqlens: Tensor | None = None, output_per_position_states: bool = False,
                 output_corrections: bool = False) -> KDARecurrentOut: ...


class KDARebuildState(Protocol):
    """`kda.rebuild_state`: the state after the first num_kept[n] of L recorded tokens
    (speculative rollback "recover", RecoverSSM-style), equal to replaying the recurrence's
    state update S = S * exp(g_t)[:, None] + k_t u_t^T over the kept tokens.

    initial_state `[N, HV, K, V]` (the state before the tokens); k `[N, L, HV, K]` the
    L2-normalised keys expanded to the value heads; g `[N, L, HV, K]` log decays; u
    `[N, L, HV, V]` the corrections of `KDARecurrentOut`; num_kept `[N]` int in [0, L].
    Positions at or past num_kept[n] are never read (they may hold NaN). No host
    synchronisation. Returns `[N, HV, K, V]` in the compute dtype.
    """

    def __call__(self, initial_state: Tensor, k: Tensor, g: Tensor, u: Tensor, num_kept: Tensor) -> Tensor: ...


class KDADecodeStep(Protocol):
    """`kda.decode_step`: a whole plain-decode KDA layer between the projections, for N
    one-token sequences, reading and writing their state rows in place.

    qkv `[N, 3*H*K]` pre-conv q, k, v projections (activation dtype); conv_weight `[3*H*K, W]`;
    f `[N, H, K]` raw decay logits; A_log `[H]`; dt_bias `[H, K]`; b `[N, H]` raw beta logits;
    out_gate `[N, H, V]`; o_norm_weight `[V]`; recurrent `[rows, H, K, V]` fp32 state rows (a
    cache view with any strides: either state layout); conv_state `[rows, 3*H*K, W-1]` pre-conv
    windows, oldest first; state_indices `[N]` int rows; fresh `[N]` bool (start from a zero
    state and window); lower_bound: K3's gate bound (-5.0) or None (Kimi-Linear's softplus);
    norm_eps; l2_eps; scale. Per sequence: SiLU(short_conv) with the window slid in place,
    l2_norm of q and k, `gate`, sigmoid(b), one recurrence step on the row's state (written back
    in place), gated_rms_norm(o, out_gate). Returns o `[N, H, V]` in qkv's dtype; rows not in
    state_indices are untouched; no host synchronisation.
    """

    def __call__(self, qkv: Tensor, conv_weight: Tensor, f: Tensor, A_log: Tensor, dt_bias: Tensor, b: Tensor,
                 out_gate: Tensor, o_norm_weight: Tensor, recurrent: Tensor, conv_state: Tensor,
                 state_indices: Tensor, fresh: Tensor, *, lower_bound: float | None, norm_eps: float,
                 l2_eps: float = 1e-6, scale: float | None = None) -> Tensor: ...
