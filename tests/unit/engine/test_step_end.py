"""`ModelRunner(step_end=...)` (the platform's `k3_step_end`): called once after every forward,
after the model ran (a lazy backend cuts its trace there), eager and replayed steps alike; the
reference platform has none."""

from types import SimpleNamespace

import torch

from k3.engine.runner import ModelRunner
from k3.model.metadata import ForwardMetadata


def _meta() -> ForwardMetadata:
    return ForwardMetadata.build([[1, 2, 3], [4]], context_lens=[0, 5], state_indices=[0, 1],
                                 block_table=torch.tensor([[2], [3]]), page_size=16)


def test_step_end_runs_after_every_forward():
    events = []

    def model(meta, views, tap_layers=()):
        events.append("model")
        return SimpleNamespace(logits=torch.zeros(meta.num_seqs, 8))

    class Graphs:                       # a replayed step ends the same way
        def covers(self, meta):
            return meta.num_tokens == meta.num_seqs

        def run(self, meta):
            events.append("replay")
            return torch.zeros(meta.num_seqs, 8)

    runner = ModelRunner(model, SimpleNamespace(views=None), block_size=16, vocab_size=8, device="cpu",
                         graphs=Graphs(), step_end=lambda: events.append("end"))
    runner.forward(_meta())
    decode = ForwardMetadata.build([[1], [4]], context_lens=[3, 5], state_indices=[0, 1],
                                   block_table=torch.tensor([[2], [3]]), page_size=16)
    runner.forward(decode)
    assert events == ["model", "end", "replay", "end"]


def test_reference_platform_has_no_step_end():
    from k3.platform import select_platform

    assert select_platform("reference").step_end is None
