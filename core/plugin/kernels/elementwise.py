"""Norm and activation kernel entries: `ElementwiseKernels`. Shapes `[..., D]` with any leading
dimensions; each returns x.dtype, computed in fp32 (fp64 for float64) and cast back once."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from torch import Tensor


class RMSNorm(Protocol):
    """`elementwise.rms_norm`: K3's RMSNorm (`KimiRMSNorm`): x / sqrt(mean(x^2) + eps) in fp32, cast
    to x.dtype, then times weight `[D]` (None: no weight)."""

    def __call__(self, x: Tensor, weight: Tensor | None, eps: float) -> Tensor: ...


class NormedResidual(NamedTuple):
    """What `AddRMSNorm` returns: the normed hidden state and the new residual, `[..., D]` each."""

    normed: Tensor
    residual: Tensor


class AddRMSNorm(Protocol):
    """`elementwise.add_rms_norm`: the pre-norm residual step of a plain residual stream (Kimi-Linear):
    residual' = (residual + x) cast to residual.dtype, then `RMSNorm`(residual', weight, eps). x,
    residual `[..., D]`; weight `[D]`. Returns `NormedResidual`(normed, residual'), both
    residual.dtype."""

    def __call__(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> NormedResidual: ...


class GatedRMSNorm(Protocol):
    """`elementwise.gated_rms_norm`: the KDA output norm RMS_w(x) * act(gate), all in fp32, cast
    once. x, gate `[..., D]` (D the head dim); weight `[D]`; activation "sigmoid" (K3,
    Kimi-Linear) or "silu"."""

    def __call__(self, x: Tensor, gate: Tensor, weight: Tensor, eps: float, *, activation: str = "sigmoid") -> Tensor: ...


class LayerNorm(Protocol):
    """`elementwise.layer_norm`: LayerNorm with optional affine weight, bias `[D]` (the DSA
    indexer's `k_norm`)."""

    def __call__(self, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor: ...


class L2Norm(Protocol):
    """`elementwise.l2_norm`: x / sqrt(sum(x^2) + eps) over the last axis (eps inside the sqrt)."""

    def __call__(self, x: Tensor, eps: float = 1e-6) -> Tensor: ...


class GLUActivation(Protocol):
    """`elementwise.glu_activation`: x `[..., 2I]` = `[gate | up]` -> `[..., I]`. activation
    "situ": beta tanh(gate / beta) sigmoid(gate) times up, or linear_beta tanh(up / linear_beta)
    when linear_beta is given (beta required, K3: 4.0); "silu": silu(gate) * up (beta ignored)."""

    def __call__(self, x: Tensor, *, activation: str, beta: float | None = None,
                 linear_beta: float | None = None) -> Tensor: ...


class Sigmoid(Protocol):
    """`elementwise.sigmoid`: 1 / (1 + exp(-x)) of x `[...]` in the compute dtype (fp32; fp64 for
    float64), not cast back: the KDA beta and the MLA output gate multiply in fp32."""

    def __call__(self, x: Tensor) -> Tensor: ...
