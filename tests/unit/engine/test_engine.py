"""The engine: continuous batching, chunked prefill, adaptive budget, preemption by recompute,
cancellation, stop conditions. Token-equality checks run in float64 (DESIGN.md "Testing equality")."""

import pytest

from engines import tiny_engine
from k3.engine.params import SamplingParams, SamplingParamsError


@pytest.fixture(scope="module")
def ckpt(tokenized_checkpoint):
    return tokenized_checkpoint("k3.1-pro-tiny")


_engine = tiny_engine


PROMPTS = [[(13 * i + 7 * j) % 380 + 1 for j in range(n)] for i, n in enumerate((30, 5, 19, 41, 2))]


def _run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(prompts))]


GREEDY = SamplingParams(max_tokens=12, temperature=0)


def test_batched_equals_alone(ckpt):
    """Five requests in one batch give the tokens each gets alone, as `k3 generate` runs it (one
    sequence, the whole prompt in one call, then one token a step)."""
    engine = _engine(ckpt)
    start_free = engine.pool.num_free
    together = [o.outputs[0].token_ids for o in _run(engine, PROMPTS, GREEDY)]
    assert engine.pool.num_free == start_free
    lone = _engine(ckpt, max_num_seqs=1)
    for prompt, tokens in zip(PROMPTS, together):
        assert tokens == _run(lone, [prompt], GREEDY)[0].outputs[0].token_ids


@pytest.mark.parametrize("budget", [4, 16])
def test_chunked_prefill_gives_the_same_tokens(ckpt, budget):
    reference = [o.outputs[0].token_ids for o in _run(_engine(ckpt), PROMPTS, GREEDY)]
    engine = _engine(ckpt, max_num_batched_tokens=budget)
    engine.scheduler.config = type(engine.scheduler.config)(**{**engine.scheduler.config.__dict__,
                                                                "adaptive_token_limit": 0})
    assert [o.outputs[0].token_ids for o in _run(engine, PROMPTS, GREEDY)] == reference


def test_adaptive_budget_prefills_a_lone_request_in_one_call(ckpt):
    engine = _engine(ckpt, max_num_batched_tokens=4)
    engine.add_request("lone", PROMPTS[3], GREEDY)
    first = engine.scheduler.schedule()
    assert first.scheduled[0].num_new_tokens == len(PROMPTS[3])       # not cut at 4
    engine.scheduler.commit(first)


def test_preemption_by_recompute_keeps_tokens_and_frees_rows(ckpt):
    reference = [o.outputs[0].token_ids for o in _run(_engine(ckpt), PROMPTS, SamplingParams(max_tokens=30, temperature=0))]
    engine = _engine(ckpt, kv_cache_memory_gib=None, block_size=16)
    engine.pool.__init__(12)                         # a deliberately small cache: 12 rows of 16 tokens
    engine.scheduler.pool = engine.pool
    outs = _run(engine, PROMPTS, SamplingParams(max_tokens=30, temperature=0))
    assert engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert engine.pool.num_free == 12


def test_abort_frees_rows_at_once(ckpt):
    engine = _engine(ckpt)
    start = engine.pool.num_free
    engine.add_request("a", PROMPTS[3], SamplingParams(max_tokens=50, temperature=0))
    engine.add_request("b", PROMPTS[0], SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    engine.step()
    assert engine.pool.num_free < start
    engine.abort_request("a")
    engine.abort_request("b")
    assert engine.pool.num_free == start and not engine.has_unfinished_requests()


def test_stop_conditions(ckpt):
    engine = _engine(ckpt)
    free = _run(engine, [PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0, skip_special_tokens=False))[0]
    tokens, text = free.outputs[0].token_ids, free.outputs[0].text
    assert free.outputs[0].finish_reason == "length" and len(tokens) == 20
    stopped = _run(engine, [PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[tokens[5]]))[0]
    first = tokens.index(tokens[5])
    assert stopped.outputs[0].token_ids == tokens[:first + 1] and stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == tokens[5]
    printable = [i for i in range(3, len(text) - 2) if text[i: i + 2].isprintable() and text[i: i + 2].strip()]
    if printable:
        s = text[printable[0]: printable[0] + 2]
        out = _run(engine, [PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0, stop=[s],
                                                       skip_special_tokens=False))[0].outputs[0]
        assert out.text == text[: text.index(s)] and out.stop_reason == s and out.finish_reason == "stop"


def test_n_seeds_and_logprobs(ckpt):
    engine = _engine(ckpt)
    params = SamplingParams(n=3, max_tokens=6, temperature=3.0, seed=11, logprobs=2)
    a = _run(engine, [PROMPTS[1]], params)[0]
    b = _run(engine, [PROMPTS[1]], params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    for c in a.outputs:
        assert len(c.logprobs) == 6 and all(len(entry) >= 2 for entry in c.logprobs)
        assert c.cumulative_logprob == pytest.approx(sum(entry[t] for entry, t in zip(c.logprobs, c.token_ids)))


def test_min_tokens_blocks_end_of_message(ckpt):
    engine = _engine(ckpt)
    eos = sorted(engine.outputs.stop_token_ids)[0]
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0, allowed_tokens=lambda out: [eos, 5])
    out = _run(engine, [PROMPTS[1]], params)[0].outputs[0]
    assert out.token_ids == [5] * 8 and out.finish_reason == "length"


def test_bad_requests():
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_prompt_over_the_limit(ckpt):
    engine = _engine(ckpt, max_model_len=64)
    with pytest.raises(ValueError, match="context is 64"):
        engine.add_request("x", list(range(1, 80)), GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("y", [1, 99999], GREEDY)
    assert not engine.has_unfinished_requests()


def test_max_num_seqs_caps_the_running_batch(ckpt):
    reference = [o.outputs[0].token_ids for o in _run(_engine(ckpt), PROMPTS, GREEDY)]
    engine = _engine(ckpt, max_num_seqs=2)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    done, widest = {}, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        widest = max(widest, len(engine.scheduler.running))
        done.update({o.request_id: o.outputs[0].token_ids for o in outputs if o.finished})
    assert widest == 2 and [done[f"r{i}"] for i in range(len(PROMPTS))] == reference


def test_adaptive_budget_still_splits_a_prompt_longer_than_its_bound(ckpt):
    engine = _engine(ckpt, max_num_batched_tokens=4)
    engine.scheduler.config = type(engine.scheduler.config)(**{**engine.scheduler.config.__dict__,
                                                                "adaptive_token_limit": 16})
    engine.add_request("lone", PROMPTS[3], GREEDY)                        # 41 tokens
    chunks = []
    while engine.requests["lone"].num_computed_tokens < len(PROMPTS[3]):
        chunks.append(engine.requests["lone"].num_computed_tokens)
        engine.step()
    assert chunks == [0, 16, 32]


def test_default_context_is_the_smaller_of_the_config_and_the_cache(ckpt):
    engine = _engine(ckpt)
    cache_tokens = (engine.pool.num_rows - 1) * engine.plan.block_size
    assert engine.max_model_len == min(engine.model_config.max_position_embeddings, cache_tokens)
    small = _engine(ckpt, kv_cache_memory_gib=0.002)
    assert small.max_model_len < engine.max_model_len and small.max_model_len == (small.pool.num_rows - 1) * \
        small.plan.block_size



def test_one_token_steps_lead_every_batch_and_the_metadata_counts_them(ckpt):
    """Chunked prefill beside decodes: the scheduler puts the one-token steps first and
    build_metadata's num_decodes counts them (the KDA layers split mixed batches there)."""
    engine = _engine(ckpt, max_num_batched_tokens=8)
    engine.scheduler.config = type(engine.scheduler.config)(**{**engine.scheduler.config.__dict__,
                                                                "adaptive_token_limit": 0})
    schedule, forward, seen = engine.scheduler.schedule, engine.runner.forward, []

    def record_schedule():
        out = schedule()
        seen.append([s.num_new_tokens for s in out.scheduled])
        return out

    def record_forward(meta, row_copies=()):
        seen[-1] = (seen[-1], meta.num_decodes)
        return forward(meta, row_copies)

    engine.scheduler.schedule, engine.runner.forward = record_schedule, record_forward
    _run(engine, PROMPTS, GREEDY)
    steps = [s for s in seen if isinstance(s, tuple)]
    mixed = [(lens, d) for lens, d in steps if 1 in lens and max(lens) > 1]
    assert mixed, "the budget should mix decodes with prefill chunks"
    for lens, num_decodes in steps:
        ones = lens.count(1)
        assert lens[:ones] == [1] * ones and num_decodes == ones, (lens, num_decodes)


def test_the_scheduler_puts_one_token_steps_first_whatever_the_running_order(ckpt):
    engine = _engine(ckpt, max_num_batched_tokens=40)
    engine.scheduler.config = type(engine.scheduler.config)(**{**engine.scheduler.config.__dict__,
                                                                "adaptive_token_limit": 0})
    engine.add_request("short", PROMPTS[4], GREEDY)               # 2 tokens: decoding after one step
    engine.add_request("long", PROMPTS[3], GREEDY)                # 41 tokens: 38 of them in the first step
    engine.step()
    engine.scheduler.running.reverse()                            # the prefilling request ahead
    out = engine.scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("short", 1), ("long", 3)]
