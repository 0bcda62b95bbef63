"""`k3 conformance`: check a platform against the reference, or merge reports.

    k3 conformance --platform NAME [--tier smoke|full] [--report DIR] [-k EXPR] [--expectations FILE]
    k3 conformance merge DIR... --out FILE

The run form checks the platform and its conformance.toml files first (an unavailable platform
is one sentence on stderr and exit code 2, before any test starts), then runs pytest on the
installed `k3.conformance.tests` in a subprocess, which writes DIR/report.json and
DIR/report.md; the run's temporary files (pytest's, the tiny checkpoints, the collectives
workers' rendezvous) live in one scratch folder removed at its end. Exit codes: 0 nothing
failed; 1 a case failed (also when pytest crashed or was interrupted); 2 the platform is
unavailable or the arguments are wrong (pytest's usage error 4 and "nothing collected" 5 map
here). pytest's own codes are never passed through. pytest comes with the `conformance` extra
(and every vendor extra); without it the run form is one line naming `pip install 'k3[conformance]'`.

`merge` renders one markdown support matrix (family x dtype per platform) from report
directories (or report.json files).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import fail

# pytest exit code -> k3 conformance exit code
EXIT_CODES = {0: 0, 1: 1, 2: 1, 3: 1, 4: 2, 5: 2}
NO_PYTEST = ("k3 conformance runs pytest, which is not installed here: pip install 'k3[conformance]' "
             "(every vendor extra, k3[nvidia] etc., includes it)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--platform", metavar="NAME", help="platform to check (see `k3 plugins`)")
    parser.add_argument("--tier", choices=("smoke", "full"), default="full",
                        help="smoke: one shape per case, one dtype; full (default): everything")
    parser.add_argument("--report", metavar="DIR", default="conformance-report",
                        help="where report.json and report.md go (default ./conformance-report)")
    parser.add_argument("-k", dest="keyword", metavar="EXPR", help="only tests whose id matches (pytest -k)")
    parser.add_argument("--expectations", metavar="FILE", action="append", default=[],
                        help="an extra conformance.toml of expected failures (repeatable)")
    sub = parser.add_subparsers(dest="action", metavar="{merge}")
    merge = sub.add_parser("merge", help="one markdown support matrix from several reports",
                           description="Render one markdown support matrix from several conformance reports.")
    merge.add_argument("reports", nargs="+", metavar="DIR", help="report directories (or report.json files)")
    merge.add_argument("--out", required=True, metavar="FILE", help="markdown file to write")


def pytest_command(args: argparse.Namespace, report_dir: Path, basetemp: Path) -> list[str]:
    """The pytest invocation of a run (no ini file or cache of the current directory; its
    temporary files under `basetemp`)."""
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "k3.conformance.tests", "-q", "-p", "no:cacheprovider",
           "-c", os.devnull, "--rootdir", str(report_dir), "--basetemp", str(basetemp), "--k3-platform", args.platform,
           "--k3-tier", args.tier, "--k3-report", str(report_dir)]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        cmd += ["-p", "k3.conformance.pytest_plugin"]
    for path in args.expectations:
        cmd += ["--k3-expectations", str(Path(path).resolve())]
    if args.keyword:
        cmd += ["-k", args.keyword]
    return cmd


def _has_pytest() -> bool:
    try:
        import pytest  # noqa: F401
    except ImportError:
        return False
    return True


def _check_platform(args: argparse.Namespace) -> str | None:
    """One sentence when the platform or its expectations cannot be used, else None."""
    from k3.conformance import expectations
    from k3.platform import PlatformError, select_platform

    try:
        platform = select_platform(args.platform)
        expectations.load([*platform.conformance_expectations(), *args.expectations])
    except (PlatformError, expectations.ExpectationError) as e:
        return str(e)
    return None


def _merge(args: argparse.Namespace) -> int:
    from k3.conformance.matrix import merge
    from k3.conformance.report import load

    try:
        reports = [load(path) for path in args.reports]
    except (FileNotFoundError, ValueError) as e:
        return fail(str(e))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(merge(reports))
    print(f"k3 conformance: support matrix of {len(reports)} report(s) written to {out}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "merge":
        return _merge(args)
    if not args.platform:
        return fail("--platform NAME is required (or: k3 conformance merge DIR... --out FILE)")
    if not _has_pytest():
        return fail(NO_PYTEST)
    problem = _check_platform(args)
    if problem:
        return fail(problem)
    report_dir = Path(args.report).resolve()
    report_dir.mkdir(parents=True, exist_ok=True)
    # the run's temporary files (tiny checkpoints, worker rendezvous) live here and go with it
    with tempfile.TemporaryDirectory(prefix="k3-conformance-") as scratch:
        try:
            code = subprocess.run(pytest_command(args, report_dir, Path(scratch) / "pytest")).returncode
        except KeyboardInterrupt:
            return fail("interrupted", code=1)
    mapped = EXIT_CODES.get(code, 1)
    if code == 5:
        return fail("no conformance test was selected (check -k)")
    if code == 4:
        return fail("pytest rejected the arguments (see above)")
    if (report_dir / "report.json").is_file():
        print(f"k3 conformance: report in {report_dir / 'report.md'} and {report_dir / 'report.json'}",
              file=sys.stderr)
    return mapped
