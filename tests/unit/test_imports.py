"""Every k3 module imports on its own (an import cycle shows only when its module comes first)."""

import subprocess
import sys

WALK = """
def all_modules(prefix_skip=()):
    # k3.platforms and k3.conformance live outside core/ (pyproject's package-dir): an editable
    # install maps them, so walking k3.__path__ alone would never reach a plugin module
    import k3.platforms, k3.conformance
    names = set()
    for pkg in (k3, k3.platforms, k3.conformance):
        names |= {m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")}
    return sorted(n for n in names if not n.startswith(prefix_skip))
"""

SCRIPT = """
import importlib, pkgutil, sys
import k3
""" + WALK + """
names = all_modules(("k3.__main__",))  # k3.__main__ runs the CLI
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
    assert int(done.stdout) > 200


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


BARE_INSTALL_SCRIPT = """
import importlib, importlib.abc, pkgutil, sys
BLOCKED = ("triton", "fla", "xgrammar", "llguidance", "flydsl")  # what a bare `pip install k3` lacks (pytest stays: it runs this test)
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: bare install)")
sys.meta_path.insert(0, Block())
import k3
""" + WALK + """
names = all_modules(("k3.platforms.triton_kernels.", "k3.platforms.amd.fly_kernels.", "k3.__main__",
                     "k3.structured.xgrammar_backend", "k3.structured.llguidance_backend",
                     "k3.conformance.pytest_plugin", "k3.conformance.session", "k3.conformance.tests"))
failed = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print(len(names))
sys.exit("\\n".join(failed) or None)
"""


def test_every_module_imports_without_triton():
    """CI's bare `pip install .` imports every module outside k3.platforms.triton_kernels with no
    Triton, fla-core, xgrammar or llguidance installed: a plugin module that imports a Triton kernel at the
    top (instead of where the kernel runs) fails there. The same walk here, with those packages
    blocked, fails in the unit tier instead of at the end of CI."""
    done = subprocess.run([sys.executable, "-c", BARE_INSTALL_SCRIPT], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 200
