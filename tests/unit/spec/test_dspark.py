"""DSpark-style drafting: exact outputs with either rollback, context rows equal to the
target's tapped features, draft distributions that are exactly what was sampled from."""

import json

import pytest
import torch

from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams
from k3.engine.spec.rejection import target_probs

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 3, list(range(20, 45))]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from k3.cli.checkpoint import init_checkpoint, init_draft_checkpoint

    root = tmp_path_factory.mktemp("dspark")
    return init_checkpoint("k3-tiny", root / "target", progress=False), init_draft_checkpoint("k3-tiny-dspark",
                                                                                               root / "draft")


def _engine(target, spec=None, **kw):
    return LLMEngine(EngineConfig(model=str(target), dtype="float64", kv_cache_memory_gib=0.02, max_num_seqs=4,
                                  load_progress=False, speculative_config=spec, **kw))


def _run(engine, params, prompts=PROMPTS):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("rollback", ["states", "recover"])
def test_greedy_outputs_are_exact(paths, rollback):
    target, draft = paths
    greedy = SamplingParams(max_tokens=10, temperature=0)
    expected = _run(_engine(target), greedy)
    engine = _engine(target, {"method": "dspark", "model": str(draft), "num_speculative_tokens": 4,
                              "kda_rollback": rollback})
    pages = len(engine.strategy.proposer.free)
    assert _run(engine, greedy) == expected
    assert engine.spec_stats()["spec_draft_tokens_total"] > 0
    assert engine.pool.num_free == engine.pool.num_rows and len(engine.strategy.proposer.free) == pages


@pytest.mark.parametrize("rollback", ["states", "recover"])
def test_mixed_batch_with_a_request_that_does_not_speculate(paths, rollback, tmp_path):
    """A penalised request (never speculates) shares the batch with drafting ones; the draft
    comes from `k3 checkpoint init --preset k3-tiny-dspark` (the CLI path)."""
    from k3.cli.main import main

    target, _ = paths
    draft = tmp_path / "cli-draft"
    assert main(["checkpoint", "init", "--preset", "k3-tiny-dspark", "--out", str(draft)]) == 0
    greedy = SamplingParams(max_tokens=10, temperature=0)
    penalised = SamplingParams(max_tokens=10, temperature=0, presence_penalty=0.7)
    prompts = PROMPTS + [list(range(50, 70))]

    def run(engine):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, penalised if i == 2 else greedy)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        return [done[f"r{i}"] for i in range(len(prompts))]

    expected = run(_engine(target))
    engine = _engine(target, {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3,
                              "kda_rollback": rollback})
    assert run(engine) == expected
    assert engine.spec_stats()["spec_verify_steps_total"] > 0


def test_context_rows_are_the_targets_tapped_features(paths):
    target, draft = paths
    engine = _engine(target, {"method": "dspark", "model": str(draft), "num_speculative_tokens": 2})
    proposer = engine.strategy.proposer
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=5, temperature=0))
    for _ in range(3):
        engine.step()
    request = engine.requests["r"]
    ctx = proposer.seqs["r"]
    assert ctx.observed == request.num_tokens - 1
    # the target run once over the same tokens, tapping the same layers
    from k3.cache.pool import CachePool
    from k3.model import contiguous_block_table
    from k3.model.metadata import ForwardMetadata

    tokens = request.all_token_ids[: ctx.observed]
    cache = CachePool.for_model(engine.model, 5, block_size=16).views         # a state row, then 4 pages
    meta = ForwardMetadata.build([tokens], context_lens=[0], state_indices=[0],
                                 block_table=contiguous_block_table(1, 4) + 1, page_size=16)
    taps = engine.model(meta, cache, tap_layers=proposer.cfg.target_layer_ids).taps
    features = torch.cat([taps[layer] for layer in proposer.cfg.target_layer_ids], -1)
    expected = proposer.model.context_rows(features, torch.arange(len(tokens)))
    pages = torch.tensor(ctx.pages)
    index = torch.arange(len(tokens))
    for cache_layer, rows in zip(proposer.pages, expected):
        torch.testing.assert_close(cache_layer[pages[index // 64], index % 64], rows, rtol=0, atol=1e-9)


def test_probabilistic_drafts_come_with_their_distribution(paths):
    target, draft = paths
    engine = _engine(target, {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3,
                              "draft_sample_method": "probabilistic"})
    params = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=5)
    engine.add_request("r", PROMPTS[1], params)
    engine.step()                                     # prefill: context observed, first token sampled
    request = engine.requests["r"]
    proposer = engine.strategy.proposer
    proposal = proposer.propose_batch([(request, 3)])[0]
    assert len(proposal.tokens) == 3 and proposal.probs.shape == (3, 512)
    position = request.num_tokens - 1
    pages, index = torch.tensor(proposer.seqs["r"].pages), torch.arange(position)
    context = [c[pages[index // 64], index % 64] for c in proposer.pages]
    base = proposer.model.base_logits(request.all_token_ids[-1], position, context,
                                      lambda ids: engine.model.model.embed(ids, None),
                                      lambda h: torch.nn.functional.linear(h, engine.model.lm_head_weight).float())
    previous = request.all_token_ids[-1]
    for j, token in enumerate(proposal.tokens):
        q = target_probs((base[j] + proposer.model.markov_bias(previous).float())[None], params)[0]
        torch.testing.assert_close(proposal.probs[j], q.cpu())
        assert q[token] > 0
        previous = token
    _run(engine, params, [])                           # finish the request


def test_bad_draft_is_refused(paths, tmp_path):
    target, draft = paths
    raw = json.loads((draft / "config.json").read_text())
    raw["vocab_size"] = 1024
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes((draft / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="vocab_size 1024"):
        _engine(target, {"method": "dspark", "model": str(tmp_path), "num_speculative_tokens": 2})


def test_prefix_cache_hits_leave_no_gap_in_outputs(paths):
    """A prefix-cache hit skips target tokens, so their features were never tapped: that
    request gets no drafts, and outputs stay exact."""
    target, draft = paths
    greedy = SamplingParams(max_tokens=6, temperature=0)
    prompts = [PROMPTS[1] * 3, PROMPTS[1] * 3 + [7, 8]]
    expected = _run(_engine(target), greedy, prompts)
    engine = _engine(target, {"method": "dspark", "model": str(draft), "num_speculative_tokens": 2},
                     enable_prefix_caching=True, prefix_match_unit=16, kda_checkpoint_interval=16, block_size=64)
    got = [_run(engine, greedy, [p])[0] for p in prompts]
    assert got == expected and engine.prefix_cache.stats.reused_tokens > 0
