"""Plugin discovery: the reference plugin is always registered; every entry point of the `k3`
group is loaded unless `K3_PLUGINS` (comma-separated entry-point names) leaves it out, and
registered if it declares a supported hookspec version and every hook implementation matches
a hookspec (`check_pending()`). A plugin that fails any of this is recorded with the reason
and not registered; k3 goes on without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points

import pluggy

from k3.plugin import hookspecs
from k3.plugin.markers import HOOKSPEC_VERSION, PROJECT
from k3.plugin.types import Detection

from . import reference as reference_plugin


@dataclass
class PluginRecord:
    """One discovered plugin (registered or not), for `k3 plugins` and reports."""

    name: str
    distribution: str
    version: str
    registered: bool
    reason: str = ""                     # why not registered, when it is not
    detection: Detection | None = None
    blocked: bool = False                # a platform plugin that lost the selection
    hooks: list[str] = field(default_factory=list)   # hooks it implements (kept after blocking)


@dataclass
class Discovery:
    pm: pluggy.PluginManager
    records: dict[str, PluginRecord] = field(default_factory=dict)


def _version_of(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"


def _hooks_of(pm: pluggy.PluginManager, plugin) -> list[str]:
    return sorted(caller.name for caller in pm.get_hookcallers(plugin) or [])


def discover(allow: list[str] | None = None) -> Discovery:
    """Register the reference plugin and every allowed `k3` entry point."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    found = Discovery(pm)
    pm.register(reference_plugin, name=reference_plugin.NAME)
    found.records[reference_plugin.NAME] = PluginRecord(reference_plugin.NAME, "k3", _version_of("k3"), True,
                                                        hooks=_hooks_of(pm, reference_plugin))
    for ep in entry_points(group=PROJECT):
        dist = ep.dist.name if ep.dist else "unknown"
        version = ep.dist.version if ep.dist else "unknown"
        record = PluginRecord(ep.name, dist, version, registered=False)
        found.records[ep.name] = record
        if allow is not None and ep.name not in allow:
            record.reason = "left out by K3_PLUGINS"
            continue
        try:
            plugin = ep.load()
        except Exception as e:  # a broken third-party plugin must not take k3 down
            record.reason = f"failed to import: {type(e).__name__}: {e}"
            continue
        versions = getattr(plugin, "K3_HOOKSPEC_VERSIONS", None)
        if not versions or HOOKSPEC_VERSION not in versions:
            record.reason = (f"supports hookspec versions {tuple(versions or ())}, k3 needs {HOOKSPEC_VERSION} "
                             "(declare K3_HOOKSPEC_VERSIONS in the plugin)")
            continue
        try:
            pm.register(plugin, name=ep.name)
            pm.check_pending()          # a hook implementation matching no hookspec (a typo)
        except pluggy.PluginValidationError as e:
            if pm.is_registered(plugin):
                pm.unregister(plugin)
            record.reason = f"rejected: {e}"
            continue
        record.registered = True
        record.hooks = _hooks_of(pm, plugin)
    return found


def allow_list(env=os.environ) -> list[str] | None:
    """K3_PLUGINS as a list of entry-point names (None: every plugin)."""
    value = env.get("K3_PLUGINS")
    return None if value is None else [n.strip() for n in value.split(",") if n.strip()]
