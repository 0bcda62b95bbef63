"""The pytest11 plugin is loaded everywhere but inert without --k3-platform."""

import re
import subprocess
import sys

from k3.conformance.pytest_plugin import active_session


def _pytest(*args, cwd):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd,
                          capture_output=True, text=True)


def _body(out: str) -> list[str]:
    """The output lines that do not vary between runs (no timings, no plugin list)."""
    return [re.sub(r" in [0-9.]+s", "", line) for line in out.splitlines() if not line.startswith("plugins:")]


def test_loaded_in_this_run_but_inactive(request):
    assert request.config.pluginmanager.has_plugin("k3_conformance")
    assert request.config.getoption("k3_platform") is None
    assert active_session(request.config) is None
    assert request.config.pluginmanager.get_plugin("k3-conformance-session") is None


def test_other_test_runs_do_not_change(tmp_path):
    (tmp_path / "test_plain.py").write_text("def test_one():\n    assert True\n")
    run = _pytest("-v", str(tmp_path), cwd=tmp_path)
    without = _pytest("-v", "-p", "no:k3_conformance", str(tmp_path), cwd=tmp_path)
    assert run.returncode == without.returncode == 0
    assert _body(run.stdout) == _body(without.stdout) and "k3 conformance" not in run.stdout
    assert {p.name for p in tmp_path.iterdir()} <= {"test_plain.py", "__pycache__"}
    helped = _pytest("--help", cwd=tmp_path)
    assert "--k3-platform=NAME" in helped.stdout and "inert unless --k3-platform is given" in helped.stdout


def test_conformance_tests_skip_without_a_platform(tmp_path):
    run = _pytest("-q", "-rs", "--pyargs", "k3.conformance.tests", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "5 skipped" in run.stdout and "conformance tests need --k3-platform NAME" in run.stdout
