"""Platform selection: ask every plugin's `k3_detect_platform`, pick one, block the rest.

`--platform` / `K3_PLATFORM` forces a platform (an error, exit code 2, when it is unknown or
unavailable and not forceable); otherwise the available platform with the highest priority
wins (a tie is an error naming both), the reference when none is available. Every other
platform plugin (one that detected a platform, or whose detection failed) is then blocked, so
its hooks no longer answer: a vendor hook never needs to check which platform was selected.
Plugins that detect no platform (kernel-only plugins) and the reference plugin, the fallback of
every hook, stay registered.
"""

from __future__ import annotations

from k3.plugin.types import Detection, PlatformInfo

from . import reference as reference_plugin
from .calls import call_impl, ordered_impls
from .discovery import Discovery


class PlatformError(RuntimeError):
    """The requested platform cannot run here; the message is one sentence for the user."""


def detect(found: Discovery) -> tuple[dict[str, Detection], list[str]]:
    """(platform name -> Detection, plugins whose detection raised), asking each plugin once."""
    platforms: dict[str, Detection] = {}
    failed: list[str] = []
    for impl in ordered_impls(found.pm.hook.k3_detect_platform):
        try:
            result = call_impl(impl, {})
        except Exception as e:  # a broken detection must not take k3 down
            found.records[impl.plugin_name].reason = f"detection failed: {type(e).__name__}: {e}"
            failed.append(impl.plugin_name)
            continue
        if result is None:
            continue
        found.records[impl.plugin_name].detection = result
        if result.name in platforms:
            raise PlatformError(f"two plugins claim platform {result.name!r}: rename one of them")
        platforms[result.name] = result
    return platforms, failed


def _plugin_of(found: Discovery, platform: str) -> str:
    return next(name for name, rec in found.records.items() if rec.detection and rec.detection.name == platform)


def _choose(platforms: dict[str, Detection], requested: str | None) -> tuple[Detection, bool]:
    """(the chosen detection, forced)."""
    if requested:
        if requested not in platforms:
            known = ", ".join(sorted(platforms))
            raise PlatformError(f"unknown platform {requested!r}; installed platforms: {known}")
        chosen = platforms[requested]
        if not chosen.available and not chosen.forceable:
            raise PlatformError(f"platform {requested!r} is unavailable: {chosen.reason}")
        return chosen, not chosen.available
    candidates = sorted((d for d in platforms.values() if d.available), key=lambda d: -d.priority)
    top = [d for d in candidates if d.priority == candidates[0].priority]
    if len(top) > 1:
        raise PlatformError(f"platforms {', '.join(d.name for d in top)} are all available with the same "
                            "priority: choose one with --platform or K3_PLATFORM")
    return candidates[0], False


def select(found: Discovery, requested: str | None) -> PlatformInfo:
    """Pick the platform (see the module docstring) and block the other platform plugins."""
    platforms, failed = detect(found)
    chosen, forced = _choose(platforms, requested)
    winner = _plugin_of(found, chosen.name)
    for name, record in found.records.items():
        platform_plugin = record.detection is not None or name in failed
        if record.registered and platform_plugin and name not in (winner, reference_plugin.NAME):
            found.pm.set_blocked(name)
            record.blocked = True
    record = found.records[winner]
    return PlatformInfo(name=chosen.name, plugin=winner, distribution=record.distribution, version=record.version,
                        device=chosen.device, forced=forced)
