"""The conformance tests, shipped in the wheel: `pytest --pyargs k3.conformance.tests
--k3-platform NAME` or `k3 conformance --platform NAME`."""
