"""Expected failures of a platform: its plugins' conformance.toml files.

    [[xfail]]
    case = "kda.chunked/ragged3_*"   # glob on the test id "case/shape" (or a bare case name)
    dtype = "bfloat16"               # optional glob, default "*"
    reason = "fla-core's chunk kernel needs K >= 32 (issue 123)"   # required

Globs are fnmatch patterns (`*`, `?`, `[seq]`). An entry matching no test of the registry (any
tier, any dtype) is stale: it is listed in the report and the terminal summary. A file that
does not parse, an entry without a reason or with an unknown key is an `ExpectationError`.

A file may also hold one `[run]` table of runner options for its platform (`run_options`):

    [run]
    isolate = ["model.*"]     # case-name globs: each such item runs in a process of its own
                              # (k3.conformance.isolated), for runtimes that cannot take many
                              # of them in one process
    timeout_s = 600           # optional: an isolated item's process is killed after this many
                              # seconds and the item fails, saying so (bounds the run's time)
    env = { XLA_FLAGS = "..." }   # optional: environment variables set in those processes (over
                              # the runner's own); two files may not give one variable two values
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

KEYS = {"case", "dtype", "reason"}
RUN_KEYS = {"isolate", "timeout_s", "env"}


class ExpectationError(ValueError):
    """A conformance.toml that cannot be used; the message names the file and the entry."""


@dataclass(frozen=True)
class Expectation:
    """One [[xfail]] entry."""

    case: str
    dtype: str
    reason: str
    source: str               # "path/conformance.toml entry 3"

    def matches(self, test_id: str, case_name: str, dtype: str) -> bool:
        """test_id is "case/shape"; a pattern may name the case alone."""
        return ((fnmatch.fnmatchcase(test_id, self.case) or fnmatch.fnmatchcase(case_name, self.case))
                and fnmatch.fnmatchcase(dtype, self.dtype))

    def to_dict(self) -> dict:
        return {"case": self.case, "dtype": self.dtype, "reason": self.reason, "source": self.source}


def parse(text: str, source: str) -> list[Expectation]:
    """The [[xfail]] entries of one conformance.toml's text."""
    if tomllib is None:
        raise ExpectationError(f"{source}: reading conformance.toml on Python 3.10 needs tomli (pip install tomli)")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ExpectationError(f"{source}: not valid TOML: {e}") from None
    unknown_tables = set(data) - {"xfail", "run"}
    if unknown_tables:
        raise ExpectationError(f"{source}: unknown table(s) {sorted(unknown_tables)}; only [[xfail]] entries and "
                               "one [run] table exist")
    _run_table(data, source)
    entries = data.get("xfail", [])
    if not isinstance(entries, list):
        raise ExpectationError(f"{source}: xfail must be an array of tables ([[xfail]])")
    out = []
    for n, entry in enumerate(entries, 1):
        where = f"{source} entry {n}"
        unknown = set(entry) - KEYS
        if unknown:
            raise ExpectationError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: case, dtype, reason")
        if not isinstance(entry.get("case"), str) or not entry["case"].strip():
            raise ExpectationError(f"{where}: case (a glob on the test id) is required")
        reason = entry.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise ExpectationError(f"{where} ({entry['case']}): reason is required")
        dtype = entry.get("dtype", "*")
        if not isinstance(dtype, str) or not dtype.strip():
            raise ExpectationError(f"{where} ({entry['case']}): dtype must be a non-empty string")
        out.append(Expectation(entry["case"].strip(), dtype.strip(), reason.strip(), where))
    return out


def _run_table(data: dict, source: str) -> dict:
    """The checked [run] table of one file's parsed TOML ({} without one)."""
    run = data.get("run", {})
    if not isinstance(run, dict):
        raise ExpectationError(f"{source}: run must be one table ([run])")
    unknown = set(run) - RUN_KEYS
    if unknown:
        raise ExpectationError(f"{source} [run]: unknown key(s) {sorted(unknown)}; allowed: {sorted(RUN_KEYS)}")
    isolate = run.get("isolate", [])
    if not isinstance(isolate, list) or not all(isinstance(g, str) and g.strip() for g in isolate):
        raise ExpectationError(f"{source} [run]: isolate must be a list of case-name globs")
    timeout = run.get("timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ExpectationError(f"{source} [run]: timeout_s must be a positive number of seconds")
    env = run.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and k and isinstance(v, str) for k, v in env.items()):
        raise ExpectationError(f"{source} [run]: env must be a table of variable names to strings")
    return run


def run_options(paths) -> dict:
    """The runner options of every file's [run] table, merged: {"isolate": (globs...),
    "timeout_s": the smallest given, or None, "env": {name: value} of every file}."""
    isolate: list[str] = []
    timeouts: list[float] = []
    env: dict[str, str] = {}
    for path in paths:
        path = Path(path)
        if path.is_file() and tomllib is not None:
            try:
                data = tomllib.loads(path.read_text())
            except tomllib.TOMLDecodeError:
                continue                        # `load` reports it
            run = _run_table(data, str(path))
            isolate += [g.strip() for g in run.get("isolate", [])]
            timeouts += [float(run["timeout_s"])] if "timeout_s" in run else []
            for name, value in run.get("env", {}).items():
                if env.setdefault(name, value) != value:
                    raise ExpectationError(f"{path} [run]: env {name} = {value!r}, another file sets {env[name]!r}")
    return {"isolate": tuple(dict.fromkeys(isolate)), "timeout_s": min(timeouts, default=None), "env": env}


def isolated(globs, case_name: str) -> bool:
    """Whether a case is named by one of the [run] isolate globs."""
    return any(fnmatch.fnmatchcase(case_name, g) for g in globs)


def load(paths) -> list[Expectation]:
    """Every entry of every file, in order (a missing file is an error)."""
    out = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ExpectationError(f"{path}: conformance expectations file not found")
        out += parse(path.read_text(), str(path))
    return out


def first_match(expectations: list[Expectation], item) -> Expectation | None:
    """The first entry expecting this registry Item to fail."""
    return next((e for e in expectations if e.matches(item.test_id, item.case.name, item.dtype)), None)


def stale(expectations: list[Expectation], all_items) -> list[Expectation]:
    """Entries matching none of the items (pass every item of every tier and dtype)."""
    all_items = list(all_items)
    return [e for e in expectations
            if not any(e.matches(i.test_id, i.case.name, i.dtype) for i in all_items)]
