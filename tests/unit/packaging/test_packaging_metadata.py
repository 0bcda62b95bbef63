"""pyproject.toml's packaging promises: one version string, pytest only in the `conformance`
extra (which every vendor extra and `test` pull in), pydantic>=2 declared, LICENSE, CHANGELOG and
py.typed shipped."""

import ast
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import k3

ROOT = Path(__file__).resolve().parents[3]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
VENDORS = ("nvidia", "amd", "tpu", "ppu")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _version_file() -> str:
    tree = ast.parse((ROOT / "core" / "_version.py").read_text())
    (assign,) = [n for n in tree.body if isinstance(n, ast.Assign)]
    return ast.literal_eval(assign.value)


def test_version_has_one_source():
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "k3._version.__version__"}
    assert k3.__version__ == _version_file() == version("k3")
    assert re.fullmatch(r"\d+\.\d+\.\d+(\S*)", k3.__version__)


def test_pytest_is_only_in_the_conformance_extra():
    base = {_name(r) for r in PROJECT["dependencies"]}
    assert "pytest" not in base
    assert "pydantic>=2" in PROJECT["dependencies"]
    extras = PROJECT["optional-dependencies"]
    assert any(_name(r) == "pytest" for r in extras["conformance"])
    for extra in (*VENDORS, "test"):
        assert "k3[conformance]" in extras[extra], extra
    assert "pytest" not in {_name(r) for r in extras["plots"]} and any(_name(r) == "matplotlib" for r in extras["plots"])
    assert "k3[plots]" not in extras["test"]            # the tests never need matplotlib


def test_license_changelog_and_py_typed_ship():
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert "Version 2.0" in (ROOT / "LICENSE").read_text()[:200]
    assert PROJECT["license"] == {"text": "Apache-2.0"}
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {k3.__version__}" in changelog
    assert (ROOT / "core" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["k3"]
