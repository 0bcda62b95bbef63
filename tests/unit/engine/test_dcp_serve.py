"""Decode context parallelism through the runtime (k3.LLM, as `k3 serve` builds it):
TP 2 with DCP 2 inside it (each TP rank stores every other token's MLA records) gives one
process's greedy tokens on K3.1 Pro's tiny preset (DSA, index_topk 16 below the context), and
the layouts DCP cannot run are refused before anything starts."""

import pytest

import k3
from k3.engine.config import EngineConfig
from k3.engine.distributed import DistributedConfig


@pytest.fixture(scope="module")
def ckpt(tokenized_checkpoint):
    return tokenized_checkpoint("k3.1-pro-tiny")


def test_tp2_dcp2_equals_one_process(ckpt):
    prompts = [{"prompt_token_ids": [(7 * i) % 300 + 1 for i in range(n)]} for n in (30, 5, 21)]
    params = k3.SamplingParams(max_tokens=8, temperature=0)
    one = k3.LLM(str(ckpt), dtype="float64", kv_cache_memory_gib=0.02, load_progress=False)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    dcp = k3.LLM(str(ckpt), dtype="float64", kv_cache_memory_gib=0.02, load_progress=False, tensor_parallel_size=2,
                 block_size=8,                 # several logical blocks (16 tokens) per sequence
                 decode_context_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in dcp.generate(prompts, params, use_tqdm=False)] == expected
        group = dcp.engine.engine.model.parallel.context_parallel          # rank 0's (the TP leader's) model
        assert (group.rank, group.size, group.heads_split) == (0, 2, True)
        assert group.stats.topk_calls > 0 and group.stats.stored_rows > 0
        parts = dcp.engine.engine
        assert (parts.plan.block_size, parts.scheduler.config.block_size) == (8, 16)    # a row holds 2 x 8 tokens
    finally:
        dcp.shutdown()


def test_refused_layouts(ckpt):
    with pytest.raises(ValueError, match="decode_context_parallel_size 2 must divide tensor_parallel_size 1"):
        EngineConfig(model=str(ckpt), decode_context_parallel_size=2).validate()
    with pytest.raises(ValueError, match="does not run with speculative decoding or prefix caching"):
        EngineConfig(model=str(ckpt), tensor_parallel_size=2, decode_context_parallel_size=2,
                     enable_prefix_caching=True).validate()
    with pytest.raises(ValueError, match="decode_context_parallel_size 3 must divide tensor_parallel_size 4"):
        DistributedConfig(tensor_parallel_size=4, decode_context_parallel_size=3).validate()
