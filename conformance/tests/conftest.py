"""Fixtures of the conformance tests; the items come from the case registry through the
active conformance session (see k3.conformance.pytest_plugin)."""

from __future__ import annotations

import pytest

from k3.conformance.pytest_plugin import active_session

INACTIVE = "conformance tests need --k3-platform NAME (or run `k3 conformance --platform NAME`)"


def pytest_generate_tests(metafunc):
    if "k3_item" not in metafunc.fixturenames:
        return
    session = active_session(metafunc.config)
    if session is None:
        metafunc.parametrize("k3_item", [pytest.param(None, marks=pytest.mark.skip(reason=INACTIVE))],
                             ids=["inactive"])
        return
    metafunc.parametrize("k3_item", session.params(metafunc.module.K3_FAMILIES))


@pytest.fixture(scope="session")
def k3_session(request):
    session = active_session(request.config)
    if session is None:
        pytest.skip(INACTIVE)
    return session


@pytest.fixture(scope="session")
def k3_ctx(k3_session, tmp_path_factory):
    """The RunContext every runner gets (platform, scratch directory, per-session cache)."""
    from k3.conformance.runner import RunContext

    return RunContext(k3_session.platform, workdir=tmp_path_factory.mktemp("k3-conformance"),
                      isolate=k3_session.isolate, isolate_timeout_s=k3_session.isolate_timeout_s,
                      isolate_env=k3_session.isolate_env)


@pytest.fixture
def k3_record(request):
    """record(outcome, provider=None): attach an item's outcome to its report."""
    def record(outcome, provider=None):
        request.node.user_properties.append(("k3_outcome", outcome.to_dict()))
        if provider is not None:
            request.node.user_properties.append(("k3_provider", provider))
    return record
