"""Running conformance samples with one kernel in place of a reference op, under the
interpreter (the CPU half of a device conformance run for that entry)."""

import dataclasses

from k3.conformance.registry import items
from k3.conformance.runner import RunContext, run_item
from k3.platform import select_platform


def samples(case: str, *, float64: bool = False) -> list:
    """The full tier's items of conformance case `case` (float64 rows only when asked: kernels
    hand those to the reference op)."""
    family = case.split(".")[0]
    return [i for i in items("full", (family,)) if i.case.name == case and (float64 or i.dtype != "float64")
            and interpretable(i)]


def interpretable(item) -> bool:
    """Whether the Triton interpreter can run the sample in seconds: not the prefill-chunk-sized
    ones (8K tokens), which exist for the GPU's prefill strategies; interpreted, kernels take the
    same path as at the smaller sizes."""
    return "prefill_chunk" not in item.sample.shape


def run_with(item, family: str, **entries):
    """Outcome of `item` on the reference platform with `entries` of kernel family `family`
    replaced."""
    platform = select_platform("reference")
    table = getattr(platform.kernels, family)
    platform.kernels = dataclasses.replace(platform.kernels, **{family: dataclasses.replace(table, **entries)})
    return run_item(RunContext(platform), item)


def nvidia_served(platform):
    """`platform` (the reference one) with every kernel entry the nvidia platform serves by default
    (`k3.platforms.nvidia.experimental.PROMOTED`, the later of two for one entry) in place of its
    own, as the nvidia plugin's kernel hooks build them: the nvidia platform on the CPU, under the
    interpreter."""
    from k3.platforms.nvidia import experimental

    tables = {}
    for kernel in experimental.PROMOTED.values():
        family, entry = kernel.entry.split(".")
        tables.setdefault(family, {})[entry] = kernel.function()
    k = platform.kernels
    platform.kernels = dataclasses.replace(k, **{family: dataclasses.replace(getattr(k, family), **entries)
                                                 for family, entries in tables.items()})
    return platform
