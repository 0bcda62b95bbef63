"""Block Attention Residuals (`AttnResKernels`): the fused step and the plain mix.

The step writes the block bank in place: bank slots not yet written are NaN-poisoned, must stay
NaN unless the step writes them, and must never leak into h (only visible blocks are mixed).
"""

from __future__ import annotations

from k3 import reference as ref

from ..inputs import Inputs, poisoned, randn
from ..registry import Case, Sample, register


def _mix(s, t, d, *, scale=1.0):
    def make(g, dtype):
        return Inputs((randn(g, (s, t, d), dtype, scale), randn(g, (d,), dtype, d ** -0.5)), {"eps": 1e-5})
    return make


register(Case(
    "attn_res.mix", "attn_res", "attn_res.mix", reference=ref.attn_res_mix, outputs=lambda o, a, k: {"h": o},
    samples=(
        Sample("S4_T13_D64", _mix(4, 13, 64)),
        Sample("S1_T13_D64_partial_sum_only", _mix(1, 13, 64)),
        Sample("S9_T5_D128", _mix(9, 5, 128)),
        Sample("S3_T7_D96_small_rms_eps", _mix(3, 7, 96, scale=2e-3)),
    ),
    doc="Softmax over RMS-normalised source logits, weighted sum of raw sources."))


def _step(t, nb, d, *, filled, write, visible, delta=True, norm=True):
    """Bank slots < filled hold earlier blocks; the rest are poisoned."""
    def make(g, dtype):
        bank = poisoned((t, nb, d), dtype)
        bank[:, :filled] = randn(g, (t, filled, d), dtype)
        kw = {"query": randn(g, (d,), dtype, d ** -0.5), "num_visible_blocks": visible, "write_index": write,
              "eps": 1e-5, "out_norm_weight": randn(g, (d,), dtype, 0.1, 1.0) if norm else None, "out_eps": 1e-5}
        return Inputs((randn(g, (t, d), dtype), randn(g, (t, d), dtype) if delta else None, bank), kw)
    return make


register(Case(
    "attn_res.step", "attn_res", "attn_res.step", reference=ref.attn_res,
    outputs=lambda o, a, k: {"h": o.h, "prefix": o.prefix, "blocks": a[2]},
    samples=(
        Sample("T13_NB4_D64_delta_write1_visible1_norm", _step(13, 4, 64, filled=1, write=1, visible=1)),
        Sample("T13_NB4_D64_no_delta_visible2_norm", _step(13, 4, 64, filled=2, write=None, visible=2, delta=False)),
        Sample("T9_NB3_D128_first_layer_write0_visible0_no_norm",
               _step(9, 3, 128, filled=0, write=0, visible=0, norm=False)),
        Sample("T5_NB4_D64_delta_write3_visible3_last_slot", _step(5, 4, 64, filled=3, write=3, visible=3)),
    ),
    doc="prefix += delta (rounded), block write, mix over visible blocks + prefix, RMSNorm."))
