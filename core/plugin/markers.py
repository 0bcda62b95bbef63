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

    The claim: each output row is a bitwise-reproducible function of its own input rows (and
    the cache rows it is pointed at) and of the model's shapes alone, not of how many rows share
    the call, which they are, where the row sits among them, how its sequence was chunked or
    whether it is a decode or a prefill token: no atomics, no split or block size chosen from
    the number of rows, fixed reduction orders, top-k ties broken the same way every call. The
    batch-invariant mode (`--batch-invariant`, docs/batch-invariance.md) runs decode and
    prefill through the same entries, so this is what makes a token's log-probs independent of
    its batch; the facade refuses the mode when an entry lacks the mark. A platform marks only
    what holds on its device."""

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
