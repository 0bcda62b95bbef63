"""`k3 plugins`: every plugin, its platform detection, and what the selected platform resolves to.

Lists the reference plugin, this distribution's vendor plugins and any third party's: the
distribution and version, registered or why not (K3_PLUGINS, an import error, an unsupported
hookspec version), its platform's detection (available or why not), and the hooks it
implements. Then the platform that would be selected (`--platform`, else K3_PLATFORM, else
detection), its capabilities, serving defaults, conformance expectations, and which plugin
provides each kernel entry (the reference's fallback shown as such). `--json` prints only JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from typing import TYPE_CHECKING

if TYPE_CHECKING:            # the plugin machinery (and torch) load in run() only
    from k3.platform import Platform
    from k3.plugin.types import Detection

from .common import CliError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--platform", metavar="NAME",
                        help="show this platform's selection (default: K3_PLATFORM, else detection)")
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")


def _detection(d: Detection | None) -> dict[str, Any] | None:
    if d is None:
        return None
    return {"name": d.name, "available": d.available, "reason": d.reason, "forceable": d.forceable,
            "priority": d.priority, "device": d.device}


def report(platform: Platform) -> dict[str, Any]:
    from k3.platform.reference import NAME as REFERENCE
    from k3.plugin import HOOKSPEC_VERSION, KERNEL_TABLES

    """Everything `k3 plugins` shows, as plain data."""
    info = platform.info
    records = sorted(platform.records.values(), key=lambda r: (r.name != REFERENCE, r.name))
    plugins = [{"name": r.name, "distribution": r.distribution, "version": r.version, "registered": r.registered,
                "reason": r.reason, "blocked": r.blocked, "hooks": list(r.hooks), "platform": _detection(r.detection)}
               for r in records]
    kernels = {}
    for table_cls in KERNEL_TABLES:
        for entry in table_cls.entries():
            key = f"{table_cls.FAMILY}.{entry}"
            provider = platform.kernels.providers.get(key, REFERENCE)
            kernels[key] = {"provider": provider, "fallback": provider == REFERENCE and info.plugin != REFERENCE}
    return {
        "hookspec_version": HOOKSPEC_VERSION,
        "plugins": plugins,
        "selected": {"platform": info.name, "plugin": info.plugin, "distribution": info.distribution,
                     "version": info.version, "device": info.device, "forced": info.forced},
        "capabilities": platform.capabilities.to_dict(),
        "config_defaults": platform.config_defaults(),
        "conformance_expectations": [str(p) for p in platform.conformance_expectations()],
        "kernels": kernels,
    }


def _plugin_status(p: dict[str, Any], selected: str) -> str:
    if not p["registered"]:
        return f"not registered: {p['reason']}"
    d = p["platform"]
    if d is None:
        return "registered (adds kernels, no platform)"
    state = "available" if d["available"] else "unavailable" + (", forceable" if d["forceable"] else "")
    chosen = " [selected]" if d["name"] == selected else (" [not selected]" if d["available"] else "")
    return f"platform {d['name']}{chosen}: {state} (priority {d['priority']}, device {d['device']}): {d['reason']}"


def render(data: dict[str, Any]) -> str:
    """The human-readable report."""
    sel = data["selected"]
    lines = [f"Plugins (entry-point group \"k3\", hookspec version {data['hookspec_version']}):"]
    for p in data["plugins"]:
        lines.append(f"  {p['name']}  ({p['distribution']} {p['version']})")
        lines.append(f"    {_plugin_status(p, sel['platform'])}")
        if p["hooks"]:
            lines += textwrap.wrap(f"hooks: {', '.join(p['hooks'])}", 100, initial_indent="    ",
                                   subsequent_indent="      ")
    how = "forced" if sel["forced"] else "selected"
    lines += ["", f"Platform: {sel['platform']} ({how}; plugin {sel['plugin']} from {sel['distribution']} "
                  f"{sel['version']}, device {sel['device']})", "Capabilities:"]
    for key, value in data["capabilities"].items():
        shown = ", ".join(value) if isinstance(value, list) else ("-" if value in (None, "") else value)
        lines.append(f"  {key:<22} {shown}")
    defaults = ", ".join(f"{k}={v}" for k, v in data["config_defaults"].items()) or "none"
    lines.append(f"Serving defaults: {defaults}")
    lines.append(f"Conformance expectations: {', '.join(data['conformance_expectations']) or 'none'}")
    lines.append("Kernels (entry: provider):")
    width = max(len(k) for k in data["kernels"])
    for key, k in data["kernels"].items():
        lines.append(f"  {key:<{width}}  {k['provider']}{' (reference fallback)' if k['fallback'] else ''}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from k3.platform import PlatformError, select_platform

    try:
        platform = select_platform(args.platform)
    except PlatformError as e:
        raise CliError(str(e)) from None
    data = report(platform)
    if args.json:
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(data))
    return 0
