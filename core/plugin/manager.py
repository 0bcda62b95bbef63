"""Plugin discovery and platform selection.

Discovery: the reference plugin is always registered; every entry point of the `k3` group
is loaded unless `K3_PLUGINS` (comma-separated entry-point names) leaves it out, and
registered if it declares a supported hookspec version. A plugin that fails to import or
declares no supported version is recorded with the reason and not registered.

Selection: `--platform` / `K3_PLATFORM` forces a platform (an error, exit code 2, when it is
unknown or unavailable and not forceable); otherwise the available platform with the highest
priority wins (a tie is an error naming both), the reference when none is available. The
platform plugins that lost are blocked, so only the winner's hooks (plus kernel-only plugins
and the reference) answer; then `check_pending()` rejects hook implementations that match no
hookspec.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points

import pluggy

from . import hookspecs, reference_plugin
from .markers import HOOKSPEC_VERSION, PROJECT
from .types import Detection, PlatformInfo


class PlatformError(RuntimeError):
    """The requested platform cannot run here; the message is one sentence for the user."""


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


def detect(found: Discovery) -> dict[str, Detection]:
    """platform name -> Detection, asking each registered plugin separately."""
    platforms: dict[str, Detection] = {}
    for impl in found.pm.hook.k3_detect_platform.get_hookimpls():
        try:
            result = impl.function()
        except Exception as e:  # a broken detection must not take k3 down
            found.records[impl.plugin_name].reason = f"detection failed: {type(e).__name__}: {e}"
            continue
        if result is None:
            continue
        found.records[impl.plugin_name].detection = result
        if result.name in platforms:
            raise PlatformError(f"two plugins claim platform {result.name!r}: rename one of them")
        platforms[result.name] = result
    return platforms


def _plugin_of(found: Discovery, platform: str) -> str:
    return next(name for name, rec in found.records.items() if rec.detection and rec.detection.name == platform)


def select(found: Discovery, requested: str | None) -> PlatformInfo:
    """Pick the platform (see the module docstring) and block the losers."""
    platforms = detect(found)
    if requested:
        if requested not in platforms:
            known = ", ".join(sorted(platforms))
            raise PlatformError(f"unknown platform {requested!r}; installed platforms: {known}")
        chosen = platforms[requested]
        if not chosen.available and not chosen.forceable:
            raise PlatformError(f"platform {requested!r} is unavailable: {chosen.reason}")
        forced = not chosen.available
    else:
        candidates = sorted((d for d in platforms.values() if d.available), key=lambda d: -d.priority)
        top = [d for d in candidates if d.priority == candidates[0].priority]
        if len(top) > 1:
            raise PlatformError(f"platforms {', '.join(d.name for d in top)} are all available with the same "
                                "priority: choose one with --platform or K3_PLATFORM")
        chosen, forced = candidates[0], False
    winner = _plugin_of(found, chosen.name)
    for name, record in found.records.items():
        if record.registered and record.detection and name not in (winner, reference_plugin.NAME):
            found.pm.set_blocked(name)
            record.blocked = True
    record = found.records[winner]
    return PlatformInfo(name=chosen.name, plugin=winner, distribution=record.distribution, version=record.version,
                        device=chosen.device, forced=forced)


def allow_list(env=os.environ) -> list[str] | None:
    """K3_PLUGINS as a list of entry-point names (None: every plugin)."""
    value = env.get("K3_PLUGINS")
    return None if value is None else [n.strip() for n in value.split(",") if n.strip()]
