"""The tolerance rule and the comparators."""

import math

import torch

from k3.conformance import compare as cmp
from k3.conformance.registry import Tolerance

TOL = Tolerance(ratio=1e-2, floor=1e-3)


def test_ratio_is_rms_error_over_rms_reference():
    ref = torch.tensor([3.0, -4.0], dtype=torch.float64)                # RMS sqrt(12.5)
    out = ref + torch.tensor([0.01, -0.01], dtype=torch.float64)        # RMS error 0.01
    r = cmp.close("o", out, ref, TOL)
    assert math.isclose(r.ratio, 0.01 / math.sqrt(12.5), rel_tol=1e-9)
    assert r.passed and math.isclose(r.max_abs, 0.01, rel_tol=1e-9)


def test_passes_on_ratio_or_floor_fails_on_neither():
    ref = torch.linspace(1, 2, 50, dtype=torch.float64)
    assert cmp.close("o", ref * 1.005, ref, TOL).passed                  # ratio 0.005, max abs 0.01
    tiny = ref * 1e-4                                                    # near-zero output
    assert cmp.close("o", tiny * 1.5, tiny, TOL).passed                  # ratio 0.5 but max abs 1e-4 <= floor
    bad = cmp.close("o", ref * 1.05, ref, TOL)
    assert not bad.passed and "error ratio" in bad.message and bad.ratio > TOL.ratio


def test_nan_where_reference_is_finite_fails_even_within_tolerance():
    ref = torch.ones(10, dtype=torch.float64)
    out = ref.clone()
    out[3] = float("nan")
    r = cmp.close("o", out, ref, Tolerance(1.0, 1.0))
    assert not r.passed and "non-finite value(s) where the reference is finite" in r.message and "(3,)" in r.message


def test_non_finite_reference_positions_must_match():
    ref = torch.tensor([1.0, float("-inf"), float("nan")], dtype=torch.float64)
    assert cmp.close("o", ref.clone(), ref, TOL).passed                  # -inf mask and NaN poison kept
    out = ref.clone()
    out[1] = 0.0                                                         # a masked position leaked
    assert not cmp.close("o", out, ref, TOL).passed
    out = ref.clone()
    out[2] = 5.0                                                         # a poisoned slot overwritten
    assert "differ where the reference is not finite" in cmp.close("o", out, ref, TOL).message


def test_shape_and_dtype_are_checked():
    assert "shape (2,) != reference (3,)" in cmp.close("o", torch.ones(2), torch.ones(3), TOL).message
    assert cmp.dtype_check("o", torch.ones(2, dtype=torch.bfloat16), torch.float32) is not None
    assert cmp.dtype_check("i", torch.ones(2, dtype=torch.int32), torch.int64) is None    # any integer dtype


def test_exact_is_bitwise():
    a = torch.tensor([0.0, 1.5, float("nan")])
    assert cmp.exact("x", a.clone(), a).passed
    r = cmp.exact("x", torch.tensor([-0.0, 1.5, float("nan")]), a)
    assert not r.passed and math.isclose(r.ratio, 1 / 3)                 # -0.0 is not 0.0 in the bytes
    q = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
    assert not cmp.exact("q", torch.tensor([1.0, 2.5]).to(torch.float8_e4m3fn), q).passed
    assert cmp.exact("ids", torch.tensor([3, 1], dtype=torch.int32), torch.tensor([3, 1])).passed


def test_topk_sets_accept_any_order_and_tie_breaks_only():
    scores = torch.tensor([[5.0, 3.0, 3.0, 1.0, float("-inf")]], dtype=torch.float64)
    ref = torch.tensor([[0, 1, -1]])
    assert cmp.topk_sets("t", torch.tensor([[1, 0, -1]]), ref, scores).passed        # order free
    assert cmp.topk_sets("t", torch.tensor([[0, 2, -1]]), ref, scores).passed        # the other tied 3.0
    assert not cmp.topk_sets("t", torch.tensor([[0, 3, -1]]), ref, scores).passed    # 1.0 is not a tie
    assert not cmp.topk_sets("t", torch.tensor([[0, 0, -1]]), ref, scores).passed    # duplicate
    assert not cmp.topk_sets("t", torch.tensor([[0, 1, 2]]), ref, scores).passed     # wrong count
    assert not cmp.topk_sets("t", torch.tensor([[0, 4, -1]]), ref, scores).passed    # a masked position
    assert cmp.topk_sets("t", torch.tensor([[0, 3, -1]]), ref, scores, tie_tol=2.5).passed


def test_outcome_worst_and_dict():
    ok = cmp.OutputResult("a", "close", True, 1e-3, 1e-3, TOL)
    near = cmp.OutputResult("b", "close", True, 9e-3, 1e-2, TOL)
    failed = cmp.OutputResult("c", "close", False, 0.5, 1.0, TOL, "error ratio 0.5 > 0.01")
    assert cmp.Outcome([ok, near]).worst() is near
    out = cmp.Outcome([ok, failed, near])
    assert out.worst() is failed and not out.passed
    d = out.to_dict()
    assert d["error_ratio"] == 0.5 and d["tolerance"] == {"ratio": 1e-2, "floor": 1e-3}
    assert d["message"] == "c: error ratio 0.5 > 0.01"
    assert not cmp.Outcome().passed                                      # nothing compared is not a pass
