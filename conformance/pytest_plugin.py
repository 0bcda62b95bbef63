"""The k3 conformance pytest plugin (entry point `pytest11: k3_conformance`).

Inert unless --k3-platform is given: it only adds its options, imports nothing heavy, and
registers nothing, so other test runs in the same environment do not change.

    pytest --pyargs k3.conformance.tests --k3-platform NAME [--k3-tier smoke|full]
           [--k3-report DIR] [--k3-expectations FILE ...]

With --k3-platform, it selects the platform (an unavailable one is a usage error), reads the
platform plugins' conformance.toml files (plus --k3-expectations), parametrizes the tests in
`k3.conformance.tests` from the case registry, skips items whose capabilities the platform
lacks (the reason names the capability), marks expected failures xfail (with the entry's
reason), reports stale expectation entries in the terminal summary, and writes
DIR/report.json and DIR/report.md when --k3-report is given.
"""

from __future__ import annotations

import pytest

SESSION = pytest.StashKey[object]()


def pytest_addoption(parser):
    group = parser.getgroup("k3", "k3 conformance (inert unless --k3-platform is given)")
    group.addoption("--k3-platform", metavar="NAME", default=None,
                    help="run the k3 conformance suite against this platform (e.g. reference, nvidia)")
    group.addoption("--k3-tier", choices=("smoke", "full"), default="full",
                    help="smoke: one shape per case, one dtype; full (default): everything")
    group.addoption("--k3-report", metavar="DIR", default=None, help="write DIR/report.json and DIR/report.md")
    group.addoption("--k3-expectations", metavar="FILE", action="append", default=[],
                    help="an extra conformance.toml of expected failures (repeatable)")


def pytest_configure(config):
    name = config.getoption("k3_platform", None)
    if not name:
        return
    from k3.platform import PlatformError

    from .expectations import ExpectationError
    from .session import ConformanceSession

    try:
        session = ConformanceSession.start(name, tier=config.getoption("k3_tier"),
                                           report_dir=config.getoption("k3_report"),
                                           extra_expectations=config.getoption("k3_expectations"))
    except (PlatformError, ExpectationError) as e:
        raise pytest.UsageError(str(e)) from None
    config.stash[SESSION] = session
    config.pluginmanager.register(session, "k3-conformance-session")


def active_session(config):
    """The ConformanceSession of this pytest run, or None when the plugin is inert."""
    return config.stash.get(SESSION, None)
