"""Dense products (`DenseKernels`): the graph's projections and LM head, x @ weight^T."""

from __future__ import annotations

from k3 import reference as ref

from ..inputs import Inputs, randn
from ..registry import Case, Sample, register, tolerances


def _linear(t, d_in, d_out):
    return lambda g, dtype: Inputs((randn(g, (t, d_in), dtype), randn(g, (d_out, d_in), dtype, d_in ** -0.5)))


register(Case(
    "dense.linear", "dense", "dense.linear", reference=ref.linear, outputs=lambda o, a, k: {"y": o},
    tolerances=tolerances(bfloat16=(2e-2, 2e-3)),
    samples=(
        Sample("T1_in64_out192_decode", _linear(1, 64, 192)),
        Sample("T37_in64_out96", _linear(37, 64, 96)),
        Sample("T70_in128_out512_three_row_blocks", _linear(70, 128, 512)),
    ),
    doc="x @ weight^T in x's dtype (every projection and the LM head)."))
