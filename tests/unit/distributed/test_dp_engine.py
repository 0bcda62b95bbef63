"""The DP front-end without HTTP: k3.LLM(data_parallel_size=2) keeps the caller as rank 0,
balances requests over both DP ranks and gives the greedy tokens of one process; the balancing
rule; refused layouts."""

from __future__ import annotations

import pytest

import k3
from k3.engine.distributed import DistributedConfig
from k3.engine.distributed.dp_frontend import merge_snapshots, pick_rank


def _load(running, waiting, free):
    return {"running": running, "waiting": waiting, "cache_rows_free": free}


def test_pick_rank_prefers_short_queues_then_free_rows_then_low_ranks():
    assert pick_rank([_load(1, 0, 10), _load(0, 0, 5)]) == 1
    assert pick_rank([_load(0, 1, 10), _load(1, 0, 50)]) == 1       # same queue: more free rows
    assert pick_rank([_load(2, 0, 8), _load(1, 1, 8)]) == 0         # a full tie: the lowest rank
    assert pick_rank([_load(3, 0, 99), _load(0, 2, 1), _load(0, 1, 1)]) == 2


def test_merge_snapshots_sums_counts_and_keeps_rank0_means():
    a = {"running": 1, "waiting": 0, "cache_rows": 10, "cache_rows_free": 4, "requests_total": 3,
         "spec_mean_acceptance_length": 1.5, "spec_acceptance_per_position": [1.0]}
    b = {**a, "running": 2, "cache_rows_free": 9, "requests_total": 1, "spec_mean_acceptance_length": 3.0}
    m = merge_snapshots([a, b])
    assert (m["running"], m["cache_rows"], m["cache_rows_free"], m["requests_total"]) == (3, 20, 13, 4)
    assert m["spec_mean_acceptance_length"] == 1.5 and m["data_parallel_requests_total"] == [3, 1]


def test_llm_data_parallel_equals_one_process_and_balances(checkpoint):
    prompts = [{"prompt_token_ids": [(7 * i) % 300 + 1 for i in range(n)]} for n in (12, 3, 25, 7)]
    params = k3.SamplingParams(max_tokens=6, temperature=0)
    one = k3.LLM(str(checkpoint), dtype="float64", kv_cache_memory_gib=0.02, load_progress=False)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    two = k3.LLM(str(checkpoint), dtype="float64", kv_cache_memory_gib=0.02, load_progress=False,
                 data_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == expected
        assert two.engine.snapshot()["data_parallel_requests_total"] == [2, 2]
        assert two.stats()["generation_tokens_total"] == 24
    finally:
        two.shutdown()


@pytest.mark.parametrize("kwargs, message", [
    ({"data_parallel_size": 3, "nnodes": 2, "master_port": 1}, "do not split evenly over 2 nodes"),
    ({"data_parallel_size": 2, "nnodes": 2}, "need --master-addr and --master-port"),
    ({"node_rank": 1}, "outside"),
    ({"expert_parallel_size": 2}, "needs enable_expert_parallel"),
    ({"data_parallel_size": 2, "enable_expert_parallel": True, "expert_parallel_size": 4}, "must be the world size"),
    ({"data_parallel_size": 3, "enable_expert_parallel": True}, "does not divide num_experts = 8"),
    ({"timeout_s": 1, "heartbeat_s": 2}, "below the timeout"),
])
def test_refused_layouts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig(**kwargs).validate(num_experts=8)


def test_expert_parallel_before_the_model_supports_it(checkpoint, capsys):
    from k3.cli.main import main
    from k3.engine.distributed.groups import expert_parallel_available

    if expert_parallel_available():
        pytest.skip("the model has expert-parallel layers: the flag is wired")
    code = main(["serve", "--model", str(checkpoint), "--port", "0", "--data-parallel-size", "2",
                 "--enable-expert-parallel"])
    assert code == 2 and "not available yet" in capsys.readouterr().err
