"""The version of k3, in one place: pyproject.toml reads it (`[tool.setuptools.dynamic]`),
`k3.__version__` and `k3 --version` report it. Bump it here (and add a CHANGELOG.md entry)."""

__version__ = "0.1.0"
