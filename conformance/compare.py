"""Comparing a platform's outputs with the float64 oracle.

The tolerance rule (`close`): over the positions where the reference is finite,

    error ratio = RMS(out - ref) / RMS(ref),    max abs = max |out - ref|,

and an output passes when ratio <= tolerance.ratio OR max abs <= tolerance.floor (the floor
covers outputs that are legitimately near zero). Independently of the numbers, the output must
be finite wherever the reference is finite (a NaN from a read of poisoned memory fails), must
equal the reference where the reference is not finite (-inf masks, NaN-poisoned slots a kernel
must leave alone), and must have the reference's shape.

`exact` compares bit for bit (codecs on representable values, bytes, integer outputs; any
integer dtype is accepted for integer outputs). `topk_sets` compares top-k selections as sets
per row, accepting a different choice among tied (or, with `tie_tol`, near-tied) scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .registry import EXACT, Tolerance


@dataclass
class OutputResult:
    """One compared output. ratio / max_abs: see the module docstring (for exact outputs the
    ratio is the fraction of mismatching elements)."""

    name: str
    kind: str
    passed: bool
    ratio: float | None = None
    max_abs: float | None = None
    tolerance: Tolerance | None = None
    message: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "passed": self.passed, "error_ratio": _num(self.ratio),
                "max_abs_error": _num(self.max_abs),
                "tolerance": self.tolerance.to_dict() if self.tolerance else None, "message": self.message}


@dataclass
class Outcome:
    """Everything one test item found: its compared outputs and notes (e.g. near-ties skipped)."""

    outputs: list[OutputResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.outputs) and all(o.passed for o in self.outputs)

    def worst(self) -> OutputResult | None:
        """The first failed output, else the one closest to its tolerance."""
        failed = [o for o in self.outputs if not o.passed]
        if failed:
            return failed[0]

        def load(o: OutputResult) -> float:
            if o.ratio is None or o.tolerance is None:
                return -1.0
            return o.ratio / o.tolerance.ratio if o.tolerance.ratio > 0 else (0.0 if o.ratio == 0 else math.inf)

        return max(self.outputs, key=load, default=None)

    def summary(self) -> str:
        lines = [f"{o.name} [{o.kind}]: {'ok' if o.passed else 'FAILED'}"
                 + (f" ratio {o.ratio:.3g}" if o.ratio is not None else "")
                 + (f" max|err| {o.max_abs:.3g}" if o.max_abs is not None else "")
                 + (f" (tolerance ratio {o.tolerance.ratio:g}, floor {o.tolerance.floor:g})" if o.tolerance else "")
                 + (f": {o.message}" if o.message else "") for o in self.outputs]
        return "\n".join(lines + self.notes)

    def to_dict(self) -> dict:
        worst = self.worst()
        return {"error_ratio": _num(worst.ratio) if worst else None,
                "max_abs_error": _num(worst.max_abs) if worst else None,
                "tolerance": worst.tolerance.to_dict() if worst and worst.tolerance else None,
                "outputs": [o.to_dict() for o in self.outputs], "notes": list(self.notes),
                "message": next((f"{o.name}: {o.message}" for o in self.outputs if not o.passed), "")}


def _num(x):
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else str(x)


def _shape_problem(name: str, out: torch.Tensor, ref: torch.Tensor) -> str:
    if not isinstance(out, torch.Tensor):
        return f"expected a tensor, got {type(out).__name__}"
    if tuple(out.shape) != tuple(ref.shape):
        return f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    return ""


def error_stats(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, str]:
    """(ratio, max_abs, problem) of out against ref; problem is "" when the non-finite checks pass."""
    o, r = out.detach().cpu().double(), ref.detach().cpu().double()
    finite = torch.isfinite(r)
    problems = []
    bad = finite & ~torch.isfinite(o)
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        problems.append(f"{int(bad.sum())} non-finite value(s) where the reference is finite (first at {idx}: "
                        f"{o[idx].item()})")
    same_nonfinite = (o == r) | (torch.isnan(o) & torch.isnan(r))
    differ = ~finite & ~same_nonfinite
    if differ.any():
        idx = tuple(differ.nonzero()[0].tolist())
        problems.append(f"{int(differ.sum())} value(s) differ where the reference is not finite (first at {idx}: "
                        f"{o[idx].item()} vs {r[idx].item()})")
    d = (o - r)[finite & torch.isfinite(o)]
    if d.numel() == 0:
        return 0.0, 0.0, "; ".join(problems)
    max_abs = d.abs().max().item()
    rms_ref = r[finite].pow(2).mean().sqrt().item()
    rms_err = d.pow(2).mean().sqrt().item()
    ratio = rms_err / rms_ref if rms_ref > 0 else (0.0 if rms_err == 0 else math.inf)
    return ratio, max_abs, "; ".join(problems)


def close(name: str, out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> OutputResult:
    """The tolerance rule (module docstring)."""
    problem = _shape_problem(name, out, ref)
    if problem:
        return OutputResult(name, "close", False, tolerance=tol, message=problem)
    ratio, max_abs, problem = error_stats(out, ref)
    ok = not problem and (ratio <= tol.ratio or max_abs <= tol.floor)
    message = problem or ("" if ok else
                          f"error ratio {ratio:.3g} > {tol.ratio:g} and max|err| {max_abs:.3g} > {tol.floor:g}")
    return OutputResult(name, "close", ok, ratio, max_abs, tol, message)


def exact(name: str, out: torch.Tensor, ref: torch.Tensor) -> OutputResult:
    """Bit-exact for floats of the same dtype (NaN payloads aside), value-exact for integers."""
    problem = _shape_problem(name, out, ref)
    if problem:
        return OutputResult(name, "exact", False, tolerance=EXACT, message=problem)
    o, r = out.detach().cpu(), ref.detach().cpu()
    if o.is_floating_point() != r.is_floating_point():
        return OutputResult(name, "exact", False, tolerance=EXACT, message=f"dtype {o.dtype} vs reference {r.dtype}")
    if r.is_floating_point():
        of, rf = o.double(), r.double()
        equal = (of == rf) | (torch.isnan(of) & torch.isnan(rf))
        if o.dtype == r.dtype and o.element_size() == r.element_size():   # also tells -0.0 from 0.0
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[o.element_size()]
            equal = equal & ((o.view(bits) == r.view(bits)) | (torch.isnan(of) & torch.isnan(rf)))
        finite = torch.isfinite(rf) & torch.isfinite(of)
        max_abs = (of - rf)[finite].abs().max().item() if finite.any() else 0.0
    else:
        equal = o.long() == r.long()
        max_abs = (o.long() - r.long()).abs().max().item() if o.numel() else 0
    mismatches = int((~equal).sum())
    frac = mismatches / max(equal.numel(), 1)
    message = ""
    if mismatches:
        idx = tuple((~equal).nonzero()[0].tolist())
        message = (f"{mismatches} of {equal.numel()} element(s) differ "
                   f"(first at {idx}: {o[idx].item()} vs {r[idx].item()})")
    return OutputResult(name, "exact", mismatches == 0, frac, float(max_abs), EXACT, message)


def topk_sets(name: str, out: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor, *,
              tie_tol: float = 0.0) -> OutputResult:
    """Top-k index rows compared as sets (-1 = padding). A row passes when it has the
    reference's number of valid entries, no duplicates, and every chosen position scores at
    least the reference's k-th best score minus tie_tol (so ties may be broken either way).
    scores: the reference's scores [T, L] the selection was made from."""
    problem = _shape_problem(name, out, ref)
    if problem:
        return OutputResult(name, "topk", False, message=problem)
    o, r, s = out.detach().cpu().long(), ref.detach().cpu().long(), scores.detach().cpu().double()
    bad_rows, first = 0, ""
    for t in range(r.shape[0]):
        want = r[t][r[t] >= 0]
        got = o[t][o[t] >= 0]
        why = ""
        if got.numel() != want.numel():
            why = f"{got.numel()} valid entries, reference {want.numel()}"
        elif got.unique().numel() != got.numel():
            why = "duplicate positions"
        elif got.numel():
            if int(got.max()) >= s.shape[1]:
                why = f"position {int(got.max())} out of range"
            else:
                threshold = s[t, want].min()
                chosen = s[t, got]
                if not torch.isfinite(chosen).all() or (chosen < threshold - tie_tol).any():
                    extra = sorted(set(got.tolist()) - set(want.tolist()))
                    why = f"chose {extra[:4]} outside the reference's top-{want.numel()} (not a tie)"
        if why:
            bad_rows += 1
            first = first or f"row {t}: {why}"
    frac = bad_rows / max(r.shape[0], 1)
    message = f"{bad_rows} of {r.shape[0]} row(s) differ; {first}" if bad_rows else ""
    return OutputResult(name, "topk", bad_rows == 0, frac, None, EXACT, message)


def dtype_check(name: str, out, expected: torch.dtype) -> OutputResult | None:
    """A failed result when a floating output's dtype is not the contract's (None when fine).
    Integer outputs may use any integer dtype."""
    if not isinstance(out, torch.Tensor):
        return OutputResult(name, "dtype", False, message=f"expected a tensor, got {type(out).__name__}")
    if expected.is_floating_point or out.is_floating_point():
        if out.dtype != expected:
            return OutputResult(name, "dtype", False, message=f"dtype {out.dtype}, contract says {expected}")
    return None


# Variants of one kernel entry (issue 32): picked by batch size or step kind, they must round a
# 16-bit model's intermediates at the same points, so a row's result depends on its batch only
# through fp32 accumulation order. Rounding one value to bf16 has an error ratio of about u / 2
# (u = 2^-8, bf16's unit roundoff): each rounding point one variant has and another lacks (or
# places elsewhere) adds a difference of that order to every element. Two variants that round at
# the same points differ only where fp32 order moves a value across a rounding boundary: then by
# one ulp (at most 2u relative), on a fraction f of the elements (about 0.2% for a k3-sized MoE
# row, docs/batch-invariance.md), an error ratio of about 1.4 u sqrt(f). The bound u / 4 leaves
# room for f up to ~3% and sits 2-4x below a single misplaced rounding point. An fp32 output has
# no 16-bit rounding point: its variants may differ by accumulation order alone, u32 = 2^-24 times
# sqrt(K) for K <= 2^12 terms and a modest cancellation, 2^-16.
VARIANT_RATIO = {torch.bfloat16: 2.0 ** -10, torch.float16: 2.0 ** -13, torch.float32: 2.0 ** -16,
                 torch.float64: 2.0 ** -40}


def variants_agree(name: str, got: torch.Tensor, want: torch.Tensor, *,
                   rounding: torch.dtype | None = None) -> OutputResult:
    """Two variants' outputs for the same rows (`got` from the variant under test, `want` from the
    row computed alone) within VARIANT_RATIO of their dtype, or of `rounding` (the dtype whose
    rounding points an fp32 output inherits: a KDA state computed from bf16 q, k, v), as the
    error ratio of `close` with no floor; the message also gives the fraction of elements that
    differ at all."""
    if got.dtype != want.dtype:
        return OutputResult(name, "variants", False, message=f"dtype {got.dtype} vs {want.dtype}")
    tol = Tolerance(VARIANT_RATIO[rounding or want.dtype], 0.0)
    result = close(name, got, want, tol)
    differ = (got.detach().cpu() != want.detach().cpu()).double().mean().item()
    result.kind = "variants"
    if not result.passed and not result.message.startswith(("shape", "expected")):
        result.message += f"; {differ:.1%} of the elements differ"
    return result
