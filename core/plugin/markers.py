"""pluggy markers of the `k3` project (hook names start with `k3_`), and the kernel marker
`batch_invariant`."""

import pluggy

PROJECT = "k3"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# Version of the hook contract (this package: hookspecs, types, kernel tables and protocols).
# Arguments only grow within a version; a plugin lists the versions it supports in its
# module-level `K3_HOOKSPEC_VERSIONS`.
HOOKSPEC_VERSION = 1


_INVARIANT = "__k3_batch_invariant__"


def batch_invariant(kernel):
    """Mark a kernel-table entry as batch invariant; returns a marked wrapper (the callable
    itself is left unmarked, so the same function may sit unmarked in another table).

    The claim: for given input shapes the entry's result is a bitwise-reproducible function of
    its inputs' values (no atomics, no split sizes or algorithm chosen from anything but the
    shapes and the contract's constants, top-k ties broken the same way every call), and each
    output row depends only on its own rows of the inputs (and the cache rows it is pointed
    at). The batch-invariant mode (`--batch-invariant`, docs/batch-invariance.md) calls every
    entry at one fixed problem shape per token, so this is what makes a token's result
    independent of its batch; the facade refuses the mode when an entry lacks the mark.
    A platform marks only what holds on its device."""

    def marked(*args, **kwargs):
        return kernel(*args, **kwargs)

    marked.__name__ = getattr(kernel, "__name__", "kernel")
    marked.__qualname__ = getattr(kernel, "__qualname__", marked.__name__)
    marked.__doc__ = getattr(kernel, "__doc__", None)
    marked.__wrapped__ = kernel
    setattr(marked, _INVARIANT, True)
    return marked


def is_batch_invariant(kernel) -> bool:
    """True when a kernel-table entry carries the `batch_invariant` mark."""
    return bool(getattr(kernel, _INVARIANT, False))
