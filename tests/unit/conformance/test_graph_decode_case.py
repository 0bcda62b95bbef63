"""The model.graph_decode conformance case can fail: with a capturer whose replay re-runs the
step it passes, with one whose replay does nothing (stale logits, states not stepped) it fails.
On the reference platform (no `graph_capture`) the suite skips it; the nvidia report runs it."""

import pytest

from k3.conformance.registry import items
from k3.conformance.runner import RunContext, run_item
from k3.platform import select_platform
from k3.platform.facade import Platform


class Capturer:
    def __init__(self, replays: bool):
        self.replays = replays

    def capture(self, fn):
        out = fn()
        return (lambda: out.copy_(fn())) if self.replays else (lambda: None), out


@pytest.mark.parametrize("replays", [True, False], ids=["replaying", "stale"])
def test_graph_decode_case_detects_a_capturer_that_does_not_replay(replays, monkeypatch):
    platform = select_platform("reference")
    monkeypatch.setattr(Platform, "graph_runner", property(lambda self: Capturer(replays)))
    item = next(i for i in items("smoke", ("model",)) if i.case.name == "model.graph_decode"
                and "k3-tiny" in i.sample.shape)
    outcome = run_item(RunContext(platform), item)
    assert outcome.passed == replays, outcome.summary()
