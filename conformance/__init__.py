"""k3 conformance suite: checks any platform plugin against the core reference.

- `registry`: the declarative case registry (Case, Sample, Tolerance, Item); cases live in
  `k3.conformance.cases`, one module per family.
- `compare`: the tolerance rule and the comparators (exact, top-k sets).
- `runner`: runs one item (a kernel call against the float64 oracle, or a case's own runner).
- `expectations`: conformance.toml (xfail entries, stale detection).
- `pytest_plugin` / `session`: the pytest11 plugin behind `k3 conformance` (inert without
  --k3-platform); the tests themselves are `k3.conformance.tests`.
- `report` / `matrix`: report.json / report.md and the merged support matrix.
"""
