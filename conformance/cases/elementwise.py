"""Norms and activations (`ElementwiseKernels`): rms_norm, add_rms_norm, gated_rms_norm, layer_norm,
l2_norm, glu_activation, sigmoid. Small-magnitude samples make eps matter; large ones saturate SiTU's caps."""

from __future__ import annotations

from k3 import reference as ref

from ..inputs import Inputs, randn
from ..registry import Case, Sample, register, tolerances

# one or two activation roundings: much tighter than matmul-heavy kernels
TOL = tolerances(float32=(1e-5, 1e-6), bfloat16=(8e-3, 1e-3))


def _weight(g, d, dtype):
    return randn(g, (d,), dtype, 0.1, 1.0)


def _rms(shape, *, scale=1.0, weight=True, eps=1e-5):
    def make(g, dtype):
        x = randn(g, shape, dtype, scale)
        return Inputs((x, _weight(g, shape[-1], dtype) if weight else None, eps))
    return make


register(Case(
    "elementwise.rms_norm", "elementwise", "elementwise.rms_norm", reference=ref.rms_norm, tolerances=TOL,
    samples=(
        Sample("T37_D64", _rms((37, 64))),
        Sample("B2_T5_H3_D128_noweight_eps1e-6", _rms((2, 5, 3, 128), weight=False, eps=1e-6)),
        Sample("T9_D96_small_rms_eps_dominant", _rms((9, 96), scale=3e-3)),
        Sample("T1_D33_odd", _rms((1, 33))),
    ),
    doc="K3's RMSNorm: normalise in fp32, cast, then multiply by the weight."))


def _add_rms(shape, *, scale=1.0):
    def make(g, dtype):
        x, residual = randn(g, shape, dtype, scale), randn(g, shape, dtype, 2.0 * scale)
        return Inputs((x, residual, _weight(g, shape[-1], dtype), 1e-5))
    return make


register(Case(
    "elementwise.add_rms_norm", "elementwise", "elementwise.add_rms_norm", reference=ref.add_rms_norm,
    tolerances=TOL,
    samples=(
        Sample("T37_D64", _add_rms((37, 64))),
        Sample("T9_D96_small_rms_eps_dominant", _add_rms((9, 96), scale=3e-3)),
        Sample("T1_D33_odd", _add_rms((1, 33))),
        Sample("T4_D2304_kimi_linear_width", _add_rms((4, 2304))),
    ),
    doc="The plain residual stream's add + RMSNorm (Kimi-Linear): the sum rounded to the residual's "
        "dtype, then K3's RMSNorm; returns (normed, new residual)."))


def _gated(shape, activation):
    def make(g, dtype):
        x, gate = randn(g, shape, dtype), randn(g, shape, dtype, 2.0)
        return Inputs((x, gate, _weight(g, shape[-1], dtype), 1e-5), {"activation": activation})
    return make


register(Case(
    "elementwise.gated_rms_norm", "elementwise", "elementwise.gated_rms_norm", reference=ref.gated_rms_norm,
    tolerances=TOL,
    samples=(
        Sample("T37_H4_D16_sigmoid", _gated((37, 4, 16), "sigmoid")),
        Sample("T9_D128_silu", _gated((9, 128), "silu")),
        Sample("B2_T3_H2_D128_sigmoid", _gated((2, 3, 2, 128), "sigmoid")),
    ),
    doc="KDA output norm: RMS_w(x) * act(gate), cast once."))


def _layer_norm(shape, *, affine=True, shift=0.0, eps=1e-6):
    def make(g, dtype):
        x = randn(g, shape, dtype, 1.0, shift)
        w, b = (_weight(g, shape[-1], dtype), randn(g, (shape[-1],), dtype, 0.1)) if affine else (None, None)
        return Inputs((x, w, b, eps))
    return make


register(Case(
    "elementwise.layer_norm", "elementwise", "elementwise.layer_norm", reference=ref.layer_norm, tolerances=TOL,
    samples=(
        Sample("T37_D128_affine", _layer_norm((37, 128))),
        Sample("T9_D64_no_affine", _layer_norm((9, 64), affine=False, eps=1e-5)),
        Sample("T5_D32_mean_shifted", _layer_norm((5, 32), shift=3.0)),
    ),
    doc="DSA indexer k_norm: LayerNorm with bias, fp32 inside."))


def _l2(shape, *, scale=1.0):
    return lambda g, dtype: Inputs((randn(g, shape, dtype, scale),))


register(Case(
    "elementwise.l2_norm", "elementwise", "elementwise.l2_norm", reference=ref.l2_norm, tolerances=TOL,
    samples=(
        Sample("T37_H4_K16", _l2((37, 4, 16))),
        Sample("B1_T9_H2_K128", _l2((1, 9, 2, 128))),
        Sample("T7_H2_K16_tiny_norm_eps_dominant", _l2((7, 2, 16), scale=1e-4)),
    ),
    doc="KDA q/k normalisation, eps added to the sum inside the sqrt."))


def _glu(shape, activation, *, scale=3.0, beta=None, linear_beta=None):
    def make(g, dtype):
        return Inputs((randn(g, shape, dtype, scale),),
                      {"activation": activation, "beta": beta, "linear_beta": linear_beta})
    return make


register(Case(
    "elementwise.glu_activation", "elementwise", "elementwise.glu_activation", reference=ref.glu_activation,
    tolerances=TOL,
    samples=(
        Sample("T37_I64_situ_beta4_lin25", _glu((37, 128), "situ", beta=4.0, linear_beta=25.0)),
        Sample("T9_I48_situ_saturated", _glu((9, 96), "situ", scale=40.0, beta=4.0, linear_beta=25.0)),
        Sample("T5_I32_situ_no_linear_cap", _glu((5, 64), "situ", beta=4.0)),
        Sample("B2_T13_I96_silu", _glu((2, 13, 192), "silu")),
    ),
    doc="SiTU-GLU (K3) and SiLU-GLU (Kimi-Linear) over [gate | up]."))


register(Case(
    "elementwise.sigmoid", "elementwise", "elementwise.sigmoid", reference=ref.sigmoid, tolerances=TOL,
    samples=(
        Sample("T37_H4", lambda g, dtype: Inputs((randn(g, (37, 4), dtype, 4.0),))),
        Sample("T9_D64_saturated", lambda g, dtype: Inputs((randn(g, (9, 64), dtype, 40.0),))),
    ),
    doc="The KDA beta and the MLA output gate, in the compute dtype."))
