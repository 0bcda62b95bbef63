"""A decode step (model forward + sampler) has no host synchronisation: torch.compile with
fullgraph=True captures it whole (the CPU proxy for CUDA graphs / XLA), and it computes what
eager mode computes. Dynamo's eager backend checks the capture without paying for codegen."""

import copy

import torch

from k3.cache.pool import CachePool
from k3.checkpoint.loader import load_model
from k3.engine.sampler import SamplingBatch, sample_batch
from k3.model import contiguous_block_table
from k3.model.metadata import ForwardMetadata


def test_decode_step_captures_as_one_graph(tiny_checkpoint):
    model = load_model(tiny_checkpoint("k3.1-pro-tiny"), dtype=torch.float32, progress=False)
    assert model.cfg.index_topk < 20                       # the sparse decode path is exercised
    cache = CachePool.for_model(model, 3 + 6, block_size=16).views            # 3 state rows, then 6 pages
    table = contiguous_block_table(3, 2) + 3
    prompts = [list(range(1, 21)), [6, 7, 8], list(range(30, 54))]
    model(ForwardMetadata.build(prompts, context_lens=[0, 0, 0], state_indices=[0, 1, 2], block_table=table,
                                page_size=16), cache)
    decode = ForwardMetadata.build([[20], [21], [22]], context_lens=[20, 3, 24], state_indices=[0, 1, 2],
                                   block_table=table, page_size=16)
    sampling = SamplingBatch(temperature=torch.tensor([0.0, 0.7, 1.0]), top_k=torch.tensor([0, 5, 0]),
                             top_p=torch.tensor([1.0, 0.9, 0.8]), min_p=torch.zeros(3),
                             seeds=torch.tensor([1, 2, 3]), steps=torch.tensor([0, 0, 0]))

    def step(meta, views, sb):
        out = model(meta, views)
        return sample_batch(out.logits, sb).tokens, out.logits

    torch._dynamo.reset()
    captured = torch.compile(step, fullgraph=True, backend="eager")
    cache_copy = copy.deepcopy(cache)
    tokens, logits = step(decode, cache, sampling)
    tokens_c, logits_c = captured(decode, cache_copy, sampling)
    assert tokens.tolist() == tokens_c.tolist()
    torch.testing.assert_close(logits_c, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(cache_copy.kda[0].recurrent[:3], cache.kda[0].recurrent[:3], rtol=0, atol=1e-6)
