"""Every k3 module imports on its own (an import cycle shows only when its module comes first)."""

import importlib
import pkgutil
import subprocess
import sys

import k3

SCRIPT = """
import importlib, pkgutil, sys
import k3
names = sorted(m.name for m in pkgutil.walk_packages(k3.__path__, "k3.") if m.name != "k3.__main__")  # runs the CLI
failed = []
for name in names:
    for mod in [m for m in sys.modules if m == "k3" or m.startswith("k3.")]:
        del sys.modules[mod]
    try:
        importlib.import_module(name)
    except Exception as e:  # report every failing module, not only the first
        failed.append(f"{name}: {type(e).__name__}: {e}")
print(len(names))
sys.exit("\\n".join(failed) or None)
"""


def test_each_module_imports_first():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 20


def test_pyproject_lists_every_package():
    """A non-editable install ships only the packages pyproject names: every folder with an
    __init__.py under core/, platforms/ and conformance/ must be listed (an editable install
    would import a missing one anyway, hiding the gap)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder, package in (("core", "k3"), ("platforms", "k3.platforms"), ("conformance", "k3.conformance")):
        for init in (root / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(root / folder).parts
            found.add(".".join([package, *parts]))
    assert found - listed == set(), f"packages missing from pyproject's [tool.setuptools] packages: {sorted(found - listed)}"
