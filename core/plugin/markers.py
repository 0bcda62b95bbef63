"""pluggy markers of the `k3` project (hook names start with `k3_`)."""

import pluggy

PROJECT = "k3"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# Version of the hook contract (hookspecs.py + types.py + metadata.py). Arguments only grow
# within a version; a plugin lists the versions it supports in its `k3_plugin_info`.
HOOKSPEC_VERSION = 1
