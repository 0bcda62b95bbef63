"""Speculative decoding in the engine: greedy output with speculation equals output without,
for every proposer and rollback strategy, in batches mixing speculating and non-speculating
requests (float64); an identical draft accepts everything; every row comes back."""

import pytest

from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 4, [9, 10, 11, 9, 10, 11, 9, 10, 11, 12], list(range(20, 60)), [5, 6]]
GREEDY = SamplingParams(max_tokens=20, temperature=0)
# a request with a penalty never speculates: the batch mixes both kinds
PENALISED = SamplingParams(max_tokens=20, temperature=0, presence_penalty=0.5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from k3.cli.checkpoint import init_checkpoint

    root = tmp_path_factory.mktemp("spec")
    return {name: init_checkpoint(name, root / name, progress=False) for name in ("k3.1-pro-tiny", "k3-tiny")}


def _run(path, spec, params=GREEDY, prompts=PROMPTS):
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float64", kv_cache_memory_gib=0.02, max_num_seqs=8,
                                    load_progress=False, speculative_config=spec))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, PENALISED if i == 3 else params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert engine.pool.num_free == engine.pool.num_rows
    draft = getattr(engine.strategy, "proposer", None)
    if hasattr(draft, "pool"):
        assert draft.pool.num_free == draft.pool.num_rows and not draft.seqs
    return [done[f"r{i}"] for i in range(len(prompts))], engine.spec_stats()


@pytest.fixture(scope="module")
def baseline(checkpoints):
    return _run(checkpoints["k3.1-pro-tiny"], None)[0]


@pytest.mark.parametrize("rollback", ["states", "recover"])
def test_ngram(checkpoints, baseline, rollback):
    out, stats = _run(checkpoints["k3.1-pro-tiny"], {"method": "ngram", "num_speculative_tokens": 3,
                                                      "kda_rollback": rollback})
    assert out == baseline and stats["spec_verify_steps_total"] > 0


@pytest.mark.parametrize("rollback", ["states", "recover"])
def test_identical_draft_accepts_everything(checkpoints, baseline, rollback):
    path = checkpoints["k3.1-pro-tiny"]
    out, stats = _run(path, {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4,
                             "kda_rollback": rollback})
    assert out == baseline
    assert stats["spec_accepted_tokens_total"] == stats["spec_draft_tokens_total"] > 0
    assert stats["spec_acceptance_per_position"] == [1.0] * 4


@pytest.mark.parametrize("rollback", ["states", "recover"])
def test_a_different_draft_keeps_the_output(checkpoints, baseline, rollback):
    out, stats = _run(checkpoints["k3.1-pro-tiny"], {"method": "draft_model", "model": str(checkpoints["k3-tiny"]),
                                                      "num_speculative_tokens": 3, "kda_rollback": rollback})
    assert out == baseline
    assert 0 < stats["spec_accepted_tokens_total"] < stats["spec_draft_tokens_total"]   # partial acceptance


def test_probabilistic_identical_draft_accepts_and_is_reproducible(checkpoints):
    path = checkpoints["k3.1-pro-tiny"]
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic"}
    params = SamplingParams(max_tokens=12, temperature=1.5, top_p=0.95, seed=7)
    first, stats = _run(path, spec, params, PROMPTS[:3])
    again, _ = _run(path, spec, params, PROMPTS[:3])
    assert first == again
    assert stats["spec_accepted_tokens_total"] == stats["spec_draft_tokens_total"] > 0


def test_states_rollback_reserves_scratch_rows_up_front(checkpoints):
    """The 1 + k scratch rows per running request come out of a separate pool, so the scheduler
    never plans with rows that speculation will take; a cache too small for them is refused."""
    path = checkpoints["k3.1-pro-tiny"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "kda_rollback": "states"}
    plain = LLMEngine(EngineConfig(model=str(path), dtype="float64", kv_cache_memory_gib=0.02, max_num_seqs=8,
                                   load_progress=False))
    spec_engine = LLMEngine(EngineConfig(model=str(path), dtype="float64", kv_cache_memory_gib=0.02, max_num_seqs=8,
                                         load_progress=False, speculative_config=spec))
    assert spec_engine.strategy.scratch.num_rows == 8 * (1 + 3)
    assert spec_engine.pool.num_rows == plain.pool.num_rows - 8 * (1 + 3)
    assert spec_engine.strategy.scratch.first_row == spec_engine.pool.num_rows      # disjoint row ranges
    with pytest.raises(ValueError, match="too few for the .* speculative scratch rows"):
        LLMEngine(EngineConfig(model=str(path), dtype="float64", kv_cache_memory_gib=0.02, max_num_seqs=256,
                               load_progress=False, speculative_config=spec))
