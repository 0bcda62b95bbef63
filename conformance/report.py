"""The conformance report: DIR/report.json (schema below) and DIR/report.md.

report.json, "schema_version": 1:
    schema_version  1
    date            ISO 8601 UTC time the run ended
    tier            "smoke" | "full"
    duration_s      wall time of the run
    platform        {name, plugin, distribution, version, device, forced}
    plugins         [{name, distribution, version, registered, blocked, reason, detection}]
                    every discovered plugin (detection: {name, available, reason} or null)
    device          {name, capabilities}: Capabilities.to_dict() of the selected platform
    k3_version, torch_version, python_version
    expectation_files   the conformance.toml files in use
    summary         {total, passed, failed, skipped, xfailed, xpassed}
    stale_expectations  [{case, dtype, reason, source}]: entries that matched no test
    cases           [{id ("case/shape/dtype"), nodeid, case, family, entry, dtype, shape,
                      status (passed | failed | skipped | xfailed | xpassed), reason,
                      error_ratio, max_abs_error, tolerance {ratio, floor}, provider,
                      implementation (the serving function, "module:function [bound launch
                      options]"; inputs a kernel does not cover still go to its reference op),
                      executed_on (torch device, "(Triton interpreter)" when interpreted),
                      duration_s, outputs [{name, kind, passed, error_ratio, max_abs_error,
                      tolerance, message}], notes}]
    error_ratio / max_abs_error / tolerance are those of the case's worst output (the first
    failed one, else the one closest to its tolerance); null where nothing was compared.
    Non-finite numbers are written as strings ("inf", "nan").
"""

from __future__ import annotations

import json
import platform as py_platform
from datetime import datetime, timezone
from pathlib import Path

SCHEMA_VERSION = 1
STATUSES = ("passed", "failed", "skipped", "xfailed", "xpassed")


def platform_metadata(platform) -> dict:
    """The platform, plugin, device and version fields of a report."""
    import torch

    from k3 import __version__

    info = platform.info
    plugins = []
    for record in platform.records.values():
        det = record.detection
        plugins.append({"name": record.name, "distribution": record.distribution, "version": record.version,
                        "registered": record.registered, "blocked": record.blocked, "reason": record.reason,
                        "detection": None if det is None else
                        {"name": det.name, "available": det.available, "reason": det.reason}})
    caps = platform.capabilities
    return {"platform": {"name": info.name, "plugin": info.plugin, "distribution": info.distribution,
                         "version": info.version, "device": info.device, "forced": info.forced},
            "plugins": plugins,
            "device": {"name": caps.device_name, "capabilities": caps.to_dict()},
            "k3_version": __version__, "torch_version": torch.__version__,
            "python_version": py_platform.python_version()}


def build(metadata: dict, cases: list[dict], *, tier: str, duration_s: float, stale: list[dict],
          expectation_files: list[str]) -> dict:
    summary = {"total": len(cases), **{s: sum(c["status"] == s for c in cases) for s in STATUSES}}
    return {"schema_version": SCHEMA_VERSION, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "tier": tier, "duration_s": round(duration_s, 2), **metadata,
            "expectation_files": list(expectation_files), "summary": summary, "stale_expectations": stale,
            "cases": cases}


def write(report: dict, directory: str | Path) -> tuple[Path, Path]:
    """Write report.json and report.md into `directory` (created)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path, md_path = directory / "report.json", directory / "report.md"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    md_path.write_text(render_markdown(report))
    return json_path, md_path


def load(path: str | Path) -> dict:
    """A report.json (or a directory holding one); checks the schema version."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    if not path.is_file():
        raise FileNotFoundError(f"no conformance report at {path}")
    report = json.loads(path.read_text())
    if report.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema_version {report.get('schema_version')!r}, this k3 reads {SCHEMA_VERSION}")
    return report


def _fmt(x) -> str:
    if x is None:
        return ""
    return x if isinstance(x, str) else f"{x:.3g}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def family_table(cases: list[dict]) -> list[str]:
    """Markdown rows: family x dtype -> passed/total with the other statuses noted."""
    from .matrix import cell

    dtypes = sorted({c["dtype"] for c in cases})
    lines = ["| family | " + " | ".join(dtypes) + " |", "|---|" + "---|" * len(dtypes)]
    for family in sorted({c["family"] for c in cases}):
        row = [cell([c for c in cases if c["family"] == family and c["dtype"] == d]) for d in dtypes]
        lines.append(f"| {family} | " + " | ".join(row) + " |")
    return lines


def render_markdown(report: dict) -> str:
    p, s = report["platform"], report["summary"]
    lines = [f"# k3 conformance: {p['name']}", "",
             f"- platform `{p['name']}` (plugin `{p['plugin']}`, {p['distribution']} {p['version']}), "
             f"device `{p['device']}`: {report['device']['name'] or 'unknown'}",
             f"- k3 {report['k3_version']}, torch {report['torch_version']}, Python {report['python_version']}",
             f"- tier `{report['tier']}`, {report['date']}, {report['duration_s']} s",
             f"- {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped, {s['xfailed']} xfailed, "
             f"{s['xpassed']} xpassed of {s['total']}", ""]
    lines += ["## By family and dtype", ""] + family_table(report["cases"]) + [""]
    if report["stale_expectations"]:
        lines += ["## Stale expectations (match no test)", ""]
        lines += [f"- `{e['case']}` dtype `{e['dtype']}` ({e['source']}): {e['reason']}"
                  for e in report["stale_expectations"]] + [""]
    lines += ["## Cases", "", "| id | status | error ratio | max abs | tolerance (ratio, floor) | provider "
              "| implementation | executed on | reason |", "|---|---|---|---|---|---|---|---|---|"]
    for c in report["cases"]:
        tol = c.get("tolerance") or {}
        tol_text = f"{_fmt(tol.get('ratio'))}, {_fmt(tol.get('floor'))}" if tol else ""
        lines.append(f"| `{c['id']}` | {c['status']} | {_fmt(c.get('error_ratio'))} | {_fmt(c.get('max_abs_error'))} "
                     f"| {tol_text} | {c.get('provider', '')} | {_cell(c.get('implementation', ''))} "
                     f"| {c.get('executed_on', '')} | {_cell(c.get('reason', ''))[:200]} |")
    return "\n".join(lines) + "\n"
