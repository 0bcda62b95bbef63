"""One conformance run inside pytest: the selected platform, its expectations, the test items
(with skip / xfail marks) and the records that become the report. Registered as a pytest
plugin by `k3.conformance.pytest_plugin` only when --k3-platform is given.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from . import expectations as exp
from . import report as rep
from .registry import Item, items
from .runner import executed_on, implementation, provider


class ConformanceSession:
    """The state of one run; its methods named pytest_* are pytest hooks."""

    def __init__(self, platform, *, tier: str, report_dir: str | None, extra_expectations=()):
        self.platform, self.tier = platform, tier
        self.report_dir = Path(report_dir) if report_dir else None
        self.expectation_files = [str(p) for p in platform.conformance_expectations()] + list(extra_expectations)
        self.expectations = exp.load(self.expectation_files)
        options = exp.run_options(self.expectation_files)
        self.isolate, self.isolate_timeout_s = options["isolate"], options["timeout_s"]
        self.isolate_env = options["env"]
        self.stale = exp.stale(self.expectations, items("full"))
        self.by_nodeid: dict[str, Item] = {}
        self.records: dict[str, dict] = {}
        self.messages: dict[str, str] = {}
        self.started = time.perf_counter()

    @classmethod
    def start(cls, name: str, *, tier: str, report_dir: str | None, extra_expectations=()) -> "ConformanceSession":
        """Select the platform (PlatformError when unavailable) and read its expectations.

        On a CPU platform torch runs one intra-op thread unless OMP_NUM_THREADS says otherwise:
        the cases' tensors are tiny, and thread hand-offs made them ~10x slower on 2 cores."""
        import torch

        from k3.platform import select_platform

        platform = select_platform(name)
        if platform.info.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
        return cls(platform, tier=tier, report_dir=report_dir, extra_expectations=extra_expectations)

    # ------------------------------------------------------------------ parametrization
    def params(self, families: tuple[str, ...]) -> list:
        """pytest.param per item of this tier in `families`, with skip / xfail marks."""
        caps = self.platform.capabilities
        out = []
        for item in items(self.tier, families):
            marks = []
            missing = [r for r in item.requirements(caps) if not caps.has(r)]
            expected = exp.first_match(self.expectations, item)
            if missing:
                marks.append(pytest.mark.skip(reason=f"requires capability {missing[0]!r}, which platform "
                                                     f"{self.platform.name!r} lacks"))
            elif expected:
                marks.append(pytest.mark.xfail(reason=f"{expected.reason} [{expected.source}]", strict=False))
            out.append(pytest.param(item, id=item.id, marks=marks))
        return out

    # ------------------------------------------------------------------------ hooks
    def pytest_collection_modifyitems(self, items):
        for node in items:
            callspec = getattr(node, "callspec", None)
            if callspec is not None and isinstance(callspec.params.get("k3_item"), Item):
                self.by_nodeid[node.nodeid] = callspec.params["k3_item"]

    def _record(self, nodeid: str, item: Item) -> dict:
        if nodeid not in self.records:
            self.records[nodeid] = {
                "id": item.id, "nodeid": nodeid, "case": item.case.name, "family": item.case.family,
                "entry": item.case.entry, "dtype": item.dtype, "shape": item.sample.shape, "status": "failed",
                "reason": "", "error_ratio": None, "max_abs_error": None,
                "tolerance": item.case.tolerance(item.dtype).to_dict(),
                "provider": provider(self.platform, item.case.entry),
                "implementation": implementation(self.platform, item.case.entry),
                "executed_on": executed_on(self.platform, item.case.entry), "duration_s": 0.0, "outputs": [],
                "notes": []}
        return self.records[nodeid]

    def pytest_runtest_logreport(self, report):
        item = self.by_nodeid.get(report.nodeid)
        if item is None:
            return
        rec = self._record(report.nodeid, item)
        rec["duration_s"] = round(rec["duration_s"] + report.duration, 4)
        props = dict(report.user_properties)
        if "k3_outcome" in props:
            outcome = props["k3_outcome"]
            rec.update({k: outcome[k] for k in ("error_ratio", "max_abs_error", "outputs", "notes")})
            rec["tolerance"] = outcome["tolerance"] or rec["tolerance"]
            self.messages[report.nodeid] = outcome["message"]
        if "k3_provider" in props:
            rec["provider"] = props["k3_provider"]
        status, reason = _status(report)
        if status is None:
            return
        if report.when == "teardown" and rec["status"] != "passed":
            return                      # a teardown report never hides the call's outcome
        if status == "failed" and self.messages.get(report.nodeid):
            reason = self.messages[report.nodeid]          # the first failed output, not the assert
        rec["status"], rec["reason"] = status, reason

    def pytest_terminal_summary(self, terminalreporter):
        tr = terminalreporter
        tr.section("k3 conformance")
        s = self.summary()
        info = self.platform.info
        tr.write_line(f"platform {info.name} (plugin {info.plugin}, {info.distribution} {info.version}) on "
                      f"{info.device}: {self.platform.capabilities.device_name or 'unknown device'}")
        tr.write_line(f"tier {self.tier}: {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped, "
                      f"{s['xfailed']} xfailed, {s['xpassed']} xpassed")
        if self.stale:
            tr.write_line(f"{len(self.stale)} stale expectation(s) (match no test):")
            for e in self.stale:
                tr.write_line(f"  {e.case} dtype {e.dtype} ({e.source}): {e.reason}")
        if self.report_dir:
            tr.write_line(f"report: {self.report_dir / 'report.json'}, {self.report_dir / 'report.md'}")

    def pytest_sessionfinish(self, session):
        if self.report_dir is not None:
            rep.write(self.report(), self.report_dir)

    # ----------------------------------------------------------------------- report
    def summary(self) -> dict:
        cases = list(self.records.values())
        return {"total": len(cases), **{s: sum(c["status"] == s for c in cases) for s in rep.STATUSES}}

    def report(self) -> dict:
        return rep.build(rep.platform_metadata(self.platform), list(self.records.values()), tier=self.tier,
                         duration_s=time.perf_counter() - self.started, stale=[e.to_dict() for e in self.stale],
                         expectation_files=self.expectation_files)


def _status(report) -> tuple[str | None, str]:
    """(status, reason) a pytest report implies, or (None, "") when it implies nothing new."""
    xfail = getattr(report, "wasxfail", None)
    if report.when == "call" and xfail is not None:
        return ("xfailed" if report.skipped else "xpassed"), xfail
    if report.skipped:
        if xfail is not None:
            return "xfailed", xfail
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        return "skipped", reason.removeprefix("Skipped: ")
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        return "failed", crash.message if crash is not None else str(report.longrepr).splitlines()[-1]
    if report.when == "call":
        return "passed", ""
    return None, ""
