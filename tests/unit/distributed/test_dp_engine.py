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
    ({"data_parallel_size": 2, "expert_parallel_size": 4}, "must be a multiple of tensor_parallel_size 1 and divide"),
    ({"data_parallel_size": 2, "tensor_parallel_size": 2, "expert_parallel_size": 1}, "must be a multiple of"),
    ({"data_parallel_size": 4, "expert_parallel_size": 3}, "must be a multiple"),
    ({"data_parallel_size": 3, "enable_expert_parallel": True}, "does not divide num_experts = 8"),
    ({"timeout_s": 1, "heartbeat_s": 2}, "below the timeout"),
])
def test_refused_layouts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig(**kwargs).validate(num_experts=8)


class _Runner:
    num_forwards = 0


class _Engine:
    """What `_local_step` reads of an LLMEngine: requests left, a step that runs `forwards`."""

    def __init__(self, work: bool, forwards: int):
        self.work, self.forwards, self.runner = work, forwards, _Runner()
        self.model = self

    def has_unfinished_requests(self):
        return self.work

    def step(self):
        self.runner.num_forwards += self.forwards
        return ["out"] if self.forwards else []

    idle_forwards = 0

    def idle_forward(self):
        self.idle_forwards += 1


class _Sender:
    def __init__(self):
        self.idles = []

    def idle(self, forward=False):
        self.idles.append(forward)


@pytest.mark.parametrize("ep, work, forwards, anyone, idle_forwards, idles", [
    (False, True, 1, True, 0, []),            # a step with a forward
    (False, False, 0, True, 0, [False]),      # replicas: an idle rank heartbeats its followers
    (False, True, 0, True, 0, [False]),       # requests waiting for rows: a heartbeat too
    (True, True, 1, True, 0, []),
    (True, False, 0, True, 1, [True]),        # EP: another rank runs a forward, this one an empty one
    (True, True, 0, True, 1, [True]),         # EP: its requests scheduled nothing, still an empty forward
    (True, False, 0, False, 0, [False]),      # EP, nobody has work: a heartbeat, no collectives
])
def test_local_step_keeps_expert_parallel_ranks_in_lockstep(ep, work, forwards, anyone, idle_forwards, idles):
    from k3.engine.distributed.dp_frontend import _local_step

    engine, sender = _Engine(work, forwards), _Sender()
    cfg = DistributedConfig(data_parallel_size=2, enable_expert_parallel=ep)
    assert _local_step(engine, sender, cfg, anyone) == (["out"] if forwards else [])
    assert (engine.idle_forwards, sender.idles) == (idle_forwards, idles)


def test_local_step_refuses_several_forwards_with_expert_parallelism():
    from k3.engine.distributed import DistributedError
    from k3.engine.distributed.dp_frontend import _local_step

    cfg = DistributedConfig(data_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(DistributedError, match="ran 2 forwards"):
        _local_step(_Engine(True, 2), _Sender(), cfg, True)
    assert _local_step(_Engine(True, 2), _Sender(), DistributedConfig(data_parallel_size=2), True) == ["out"]


@pytest.mark.parametrize("options, message", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative decoding"),
    ({"async_scheduling": True}, "async_scheduling"),
])
def test_expert_parallel_refuses_steps_of_several_forwards(checkpoint, options, message):
    from k3.engine.config import EngineConfig
    from k3.engine.distributed.launch import check

    config = EngineConfig(model=str(checkpoint), data_parallel_size=2, enable_expert_parallel=True, **options)
    with pytest.raises(ValueError, match=message):
        check(config, DistributedConfig(data_parallel_size=2, enable_expert_parallel=True))


def test_an_expert_parallel_size_turns_expert_parallelism_on():
    cfg = DistributedConfig(data_parallel_size=4, expert_parallel_size=2)
    assert cfg.enable_expert_parallel and cfg.ep_size == 2
    assert DistributedConfig(data_parallel_size=4, enable_expert_parallel=True).ep_size == 4
    assert DistributedConfig(data_parallel_size=4).ep_size is None


@pytest.mark.parametrize("n, dp, ep", [(1, 2, None), (4, 2, None), (4, 4, 2)],
                         ids=["dp2xep2-one-prompt-one-idle-rank", "dp2xep2-four-prompts", "dp4-two-ep2-groups"])
def test_llm_data_parallel_with_expert_parallel_equals_one_process(checkpoint, n, dp, ep):
    """DP 2 x EP 2: the experts split over both ranks; with one prompt DP rank 1 has no tokens
    and joins every step's MoE collectives with an empty batch (idle_forward). DP 4 with EP 2:
    two expert groups of two ranks, each holding half the experts."""
    prompts = [{"prompt_token_ids": [(5 * i + n) % 300 + 1 for i in range(m)]} for m in (9, 4, 21, 6)[:n]]
    params = k3.SamplingParams(max_tokens=6, temperature=0)
    one = k3.LLM(str(checkpoint), dtype="float64", kv_cache_memory_gib=0.02, load_progress=False)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    two = k3.LLM(str(checkpoint), dtype="float64", kv_cache_memory_gib=0.02, load_progress=False,
                 data_parallel_size=dp, enable_expert_parallel=True, expert_parallel_size=ep,
                 distributed_timeout=60)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        two.shutdown()
