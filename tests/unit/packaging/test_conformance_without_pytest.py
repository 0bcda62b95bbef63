"""k3 without pytest (a bare `pip install k3`): the package and its CLI import, the pytest11
plugin module is not touched, and `k3 conformance` is one line naming the extra."""

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["pytest"] = None            # `import pytest` now raises ImportError, as when absent
import k3, k3.cli.main, k3.conformance, k3.serve, k3.checkpoint.hub
assert "k3.conformance.pytest_plugin" not in sys.modules
code = k3.cli.main.main(["conformance", "--platform", "reference", "--report", sys.argv[1]])
print(code)
"""


def test_conformance_names_the_extra_without_pytest(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "report")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("k3: error: ") and "pip install 'k3[conformance]'" in lines[0]
