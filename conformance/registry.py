"""The declarative case registry (OpInfo style).

A `Case` names one thing a platform must get right: a kernel-table entry ("kda.chunked"), a
cache-view path, a collective or the end-to-end model. It carries its sample-input generators
(`Sample`: a shape id used in test ids, fresh seeded random inputs), its oracle (the
`k3.reference` op, run in float64 on the same inputs), the dtypes it runs in, tolerances as
data (`Tolerance` per dtype, see `k3.conformance.compare` for the rule) and the capabilities it
requires (names from `Capabilities.REQUIREMENTS`).

One test item = (case, sample, dtype). Its id is `"{case}/{shape}/{dtype}"`; conformance.toml
globs match `"{case}/{shape}"` (or the bare case name) and the dtype separately.

The registry imports nothing heavy: case modules register themselves when
`k3.conformance.cases` is imported (`all_cases()` does that).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("kda", "mla", "indexer", "moe", "attn_res", "elementwise", "quant", "lora", "dense", "cache", "collectives",
            "model", "variants")
KERNEL_FAMILIES = FAMILIES[:9]
TIERS = ("smoke", "full")
DTYPES = ("float32", "bfloat16", "float64")

# capability a dtype needs (Capabilities.has); float32 is assumed everywhere
DTYPE_REQUIREMENT = {"bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


@dataclass(frozen=True)
class Tolerance:
    """An output passes when RMS(out - ref) / RMS(ref) <= ratio, or max |out - ref| <= floor
    (over the positions where the reference is finite)."""

    ratio: float
    floor: float

    def to_dict(self) -> dict[str, float]:
        return {"ratio": self.ratio, "floor": self.floor}


# Defaults per dtype. float64 is the oracle's own dtype (only summation order may differ);
# float32 leaves room for TF32 matmuls in kernels; bf16 for one or two activation roundings
# plus fp32 accumulation-order differences. A real bug gives ratios of 0.1 and more.
DEFAULT_TOLERANCES: Mapping[str, Tolerance] = {
    "float64": Tolerance(1e-9, 1e-12),
    "float32": Tolerance(2e-3, 1e-6),
    "bfloat16": Tolerance(2e-2, 1e-3),
    "float16": Tolerance(5e-3, 1e-4),
}
EXACT = Tolerance(0.0, 0.0)


def tolerances(**overrides: tuple[float, float]) -> dict[str, Tolerance]:
    """DEFAULT_TOLERANCES with some dtypes replaced: tolerances(bfloat16=(3e-2, 1e-2))."""
    out = dict(DEFAULT_TOLERANCES)
    out.update({dtype: Tolerance(*value) for dtype, value in overrides.items()})
    return out


@dataclass(frozen=True)
class Sample:
    """One input configuration of a case.

    shape: id naming the shapes and options (used in test ids: "ragged3_T101_H2_HV4").
    make: make(gen, dtype) -> Inputs on the CPU, fresh seeded random values (never zeros) in
        the kernel's dtypes; the oracle receives the same values upcast to float64. Cases with
        their own runner read `params` instead and may leave make None.
    params: free-form options for the case's runner.
    requires: capabilities needed by this sample only (on top of the case's).
    compare: per-output comparator overrides ("exact", "close", "skip", or a callable).
    """

    shape: str
    make: Callable[..., Any] | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    compare: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """One conformance case (see the module docstring).

    name: unique, e.g. "kda.chunked" or "cache.kda_state_rows".
    family: kernel-table family, or "cache", "collectives", "model".
    entry: the kernel entry exercised, "family.entry" ("kda.chunked"); for the non-kernel
        families the thing checked ("collectives.all_reduce", "model.greedy").
    reference: the k3.reference op (the oracle); None for cases whose runner composes several.
    outputs: outputs(result, args, kwargs) -> {name: tensor}; default: the returned tensor(s)
        as "out" / "out0", "out1"...; in-place written arguments are read from args/kwargs.
    compare: per-output comparator ("close" default for floats, "exact" for integers/bytes,
        "skip", or a callable (out, ref, tol, ref_inputs) -> OutputResult).
    run: a runner run(ctx, item) -> Outcome for cases that are not a single kernel call.
    requires_for: requires_for(capabilities) -> extra requirements that depend on the platform
        (collectives need "multi_device" unless the backend is gloo).
    smoke_dtype: the dtype of the smoke tier (default: float32 if listed, else the first).
    """

    name: str
    family: str
    entry: str
    samples: tuple[Sample, ...]
    reference: Callable | None = None
    dtypes: tuple[str, ...] = DTYPES
    tolerances: Mapping[str, Tolerance] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    requires: tuple[str, ...] = ()
    outputs: Callable | None = None
    compare: Mapping[str, Any] = field(default_factory=dict)
    run: Callable | None = None
    requires_for: Callable | None = None
    smoke_dtype: str | None = None
    doc: str = ""

    def tolerance(self, dtype: str) -> Tolerance:
        return self.tolerances.get(dtype) or DEFAULT_TOLERANCES[dtype]

    def smoke(self) -> str:
        return self.smoke_dtype or ("float32" if "float32" in self.dtypes else self.dtypes[0])


@dataclass(frozen=True)
class Item:
    """One test: a case, one of its samples, one dtype."""

    case: Case
    sample: Sample
    dtype: str

    @property
    def test_id(self) -> str:
        """"case/shape": what conformance.toml globs match (with dtype matched separately)."""
        return f"{self.case.name}/{self.sample.shape}"

    @property
    def id(self) -> str:
        return f"{self.test_id}/{self.dtype}"

    @property
    def seed(self) -> int:
        """Same inputs for every dtype of a sample, different per sample."""
        return zlib.crc32(self.test_id.encode())

    def requirements(self, capabilities=None) -> tuple[str, ...]:
        """Capabilities this item needs (with `capabilities`, also the platform-dependent ones)."""
        extra = (DTYPE_REQUIREMENT[self.dtype],) if self.dtype in DTYPE_REQUIREMENT else ()
        dynamic = tuple(self.case.requires_for(capabilities)) if self.case.requires_for and capabilities else ()
        return tuple(dict.fromkeys((*extra, *self.case.requires, *self.sample.requires, *dynamic)))


_CASES: dict[str, Case] = {}


def register(case: Case) -> Case:
    """Add a case; names are unique, families and dtypes known, shapes unique within a case."""
    if case.name in _CASES:
        raise ValueError(f"conformance case {case.name!r} registered twice")
    if case.family not in FAMILIES:
        raise ValueError(f"case {case.name!r}: unknown family {case.family!r}")
    if not case.samples:
        raise ValueError(f"case {case.name!r} has no samples")
    shapes = [s.shape for s in case.samples]
    if len(set(shapes)) != len(shapes):
        raise ValueError(f"case {case.name!r}: duplicate shape ids {shapes}")
    for s in shapes:
        if not s or any(c in s for c in "/[] "):
            raise ValueError(f"case {case.name!r}: shape id {s!r} must be non-empty without '/', '[', ']', ' '")
    unknown = [d for d in case.dtypes if d not in DEFAULT_TOLERANCES]
    if unknown:
        raise ValueError(f"case {case.name!r}: unknown dtypes {unknown}")
    _CASES[case.name] = case
    return case


def all_cases() -> list[Case]:
    """Every registered case (importing the built-in case modules first)."""
    from . import cases  # noqa: F401  (registers)

    return list(_CASES.values())


def items(tier: str = "full", families: tuple[str, ...] | None = None) -> list[Item]:
    """The test items of a tier: smoke = the first sample of each case in its smoke dtype;
    full = every sample in every dtype."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; choose from {TIERS}")
    out = []
    for case in all_cases():
        if families is not None and case.family not in families:
            continue
        if tier == "smoke":
            out.append(Item(case, case.samples[0], case.smoke()))
        else:
            out.extend(Item(case, sample, dtype) for sample in case.samples for dtype in case.dtypes)
    return out
