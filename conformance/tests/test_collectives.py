"""The platform's collectives against plain torch.distributed in 2 processes (family
collectives). All items of the session run in one launch of the workers."""

import pytest

from k3.conformance.cases.collectives import check, launch
from k3.conformance.registry import Item

K3_FAMILIES = ("collectives",)


@pytest.fixture(scope="session")
def collective_results(request, k3_session, k3_ctx):
    """Each rank's results for every collective item this session runs (or the launch error)."""
    wanted = []
    for node in request.session.items:
        item = getattr(node, "callspec", None) and node.callspec.params.get("k3_item")
        if isinstance(item, Item) and item.case.family == "collectives" and not node.get_closest_marker("skip"):
            wanted.append(item)
    try:
        return launch(k3_session.platform.name, wanted, k3_ctx.workdir / "collectives")
    except RuntimeError as e:
        return e


def test_collective(k3_item, collective_results, k3_record):
    if isinstance(collective_results, Exception):
        pytest.fail(str(collective_results))
    outcome, provider = check(k3_item, collective_results)
    k3_record(outcome, provider)
    assert outcome.passed, outcome.summary()
