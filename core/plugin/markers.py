"""pluggy markers of the `k3` project (hook names start with `k3_`)."""

import pluggy

PROJECT = "k3"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# Version of the hook contract (this package: hookspecs, types, kernel tables and protocols).
# Arguments only grow within a version; a plugin lists the versions it supports in its
# module-level `K3_HOOKSPEC_VERSIONS`.
HOOKSPEC_VERSION = 1
