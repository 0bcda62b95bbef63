"""The support matrix: several platforms' reports merged into one markdown table
(family x dtype rows, one column per report; cells "passed/total" with failures, expected
failures and skips noted), followed by each platform's failures, xfails and stale entries.
"""

from __future__ import annotations

from .registry import FAMILIES


def cell(cases: list[dict]) -> str:
    """"passed/total (n failed, n xfail, n skipped)" for one group of case records."""
    if not cases:
        return "-"
    count = {s: sum(c["status"] == s for c in cases) for s in ("passed", "failed", "skipped", "xfailed", "xpassed")}
    if count["skipped"] == len(cases):
        return f"skipped ({len(cases)})"
    notes = [f"{count['failed']} failed"] if count["failed"] else []
    notes += [f"{count['xfailed']} xfail"] if count["xfailed"] else []
    notes += [f"{count['xpassed']} xpass"] if count["xpassed"] else []
    notes += [f"{count['skipped']} skipped"] if count["skipped"] else []
    text = f"{count['passed'] + count['xpassed']}/{len(cases)}"
    return text + (f" ({', '.join(notes)})" if notes else "")


def executed_on(cases: list[dict]) -> str:
    """Where a report's items ran, with counts ("cpu (Triton interpreter): 280, cpu: 140"), from
    the cases' `executed_on` (skipped items left out; reports older than that field: "not recorded")."""
    counts: dict[str, int] = {}
    for c in cases:
        if c["status"] != "skipped":
            where = c.get("executed_on") or "not recorded"
            counts[where] = counts.get(where, 0) + 1
    return ", ".join(f"{where}: {n}" for where, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "nothing ran"


def _label(report: dict) -> str:
    device = report["device"]["name"] or report["platform"]["device"]
    return f"{report['platform']['name']} ({device}, {report['tier']})"


def _order(families) -> list[str]:
    known = [f for f in FAMILIES if f in families]
    return known + sorted(set(families) - set(known))


def merge(reports: list[dict]) -> str:
    """One markdown support matrix from several report.json dicts."""
    families = _order({c["family"] for r in reports for c in r["cases"]})
    dtypes = sorted({c["dtype"] for r in reports for c in r["cases"]})
    lines = ["# k3 conformance support matrix", "",
             "Cells: passed/total test items per family and dtype (xpassed counts as passed).", "",
             "| family | dtype | " + " | ".join(_label(r) for r in reports) + " |",
             "|---|---|" + "---|" * len(reports)]
    for family in families:
        for dtype in dtypes:
            row = [cell([c for c in r["cases"] if c["family"] == family and c["dtype"] == dtype]) for r in reports]
            if any(x != "-" for x in row):
                lines.append(f"| {family} | {dtype} | " + " | ".join(row) + " |")
    lines.append("")
    for r in reports:
        lines += [f"## {_label(r)}", "",
                  f"k3 {r['k3_version']}, torch {r['torch_version']}, {r['date']}; active plugins: "
                  + ", ".join(f"{p['name']} ({p['distribution']} {p['version']})" for p in r["plugins"]
                              if p["registered"] and not p["blocked"]), ""]
        noted = [c for c in r["cases"] if c["status"] in ("failed", "xfailed", "xpassed")]
        for c in noted:
            reason = (c.get("reason") or "").splitlines()
            lines.append(f"- {c['status']}: `{c['id']}`: {reason[0][:200] if reason else ''}")
        for e in r.get("stale_expectations", []):
            lines.append(f"- stale expectation: `{e['case']}` dtype `{e['dtype']}` ({e['source']})")
        if not noted and not r.get("stale_expectations"):
            lines.append("- no failures, no expected failures")
        lines.append(f"- executed on: {executed_on(r['cases'])}")
        lines.append("")
    return "\n".join(lines)
