"""SamplingParams.prompt_logprobs (vLLM's semantics): log_softmax of the teacher-forced logits at
every prompt position, whatever the chunking, batching, preemption, prefix cache or asynchronous
scheduling. float64 tiny models (DESIGN.md "Testing equality")."""

import sys
from pathlib import Path

import pytest
import torch

from engines import tiny_engine
from k3.engine.params import SamplingParams, SamplingParamsError
from k3.engine.request import Logprob

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from model_runs import teacher_forced  # noqa: E402

PROMPTS = [[(11 * i + 5 * j) % 300 + 1 for j in range(n)] for i, n in enumerate((37, 6, 23, 2, 50))]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("kimi-linear-tiny")


def _run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(prompts))]


def _expected(engine, prompts):
    """log_softmax of each prompt's teacher-forced logits (all positions in one call)."""
    return [torch.log_softmax(logits, -1) for logits in teacher_forced(engine.model, prompts)]


def _check(outputs, expected, prompts, n):
    for out, lp, prompt in zip(outputs, expected, prompts):
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for p in range(len(prompt) - 1):                  # position p scores prompt token p + 1
            entry, token, row = got[p + 1], prompt[p + 1], lp[p]
            top = row.topk(n).indices.tolist() if n else []
            assert list(entry) == [token] + [t for t in top if t != token]    # the prompt token first
            assert entry[token].rank == int((row >= row[token]).sum())
            for t, value in entry.items():
                assert abs(value.logprob - row[t].item()) < 1e-9, (p, t)
            assert [entry[t].rank for t in top] == list(range(1, n + 1))
            assert all(v.decoded_token is None for v in entry.values())       # no tokenizer


@pytest.mark.parametrize("budget", [7, 2048])
def test_prompt_logprobs_equal_the_teacher_forced_distribution(ckpt, budget):
    """Chunked prefill (a small token budget) in batches with requests that do not ask for them."""
    engine = tiny_engine(ckpt, skip_tokenizer_init=True, max_num_batched_tokens=budget)
    engine.scheduler.config = type(engine.scheduler.config)(**{**engine.scheduler.config.__dict__,
                                                                "adaptive_token_limit": 0})
    params = [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=None if i == 1 else 3)
              for i in range(len(PROMPTS))]
    outs = _run(engine, PROMPTS, params)
    assert outs[1].prompt_logprobs is None
    keep = [i for i in range(len(PROMPTS)) if i != 1]
    _check([outs[i] for i in keep], _expected(engine, [PROMPTS[i] for i in keep]), [PROMPTS[i] for i in keep], 3)
    plain = _run(tiny_engine(ckpt, skip_tokenizer_init=True), PROMPTS, SamplingParams(max_tokens=3, temperature=0))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_zero_asks_only_the_prompt_tokens(ckpt):
    engine = tiny_engine(ckpt, skip_tokenizer_init=True)
    outs = _run(engine, PROMPTS[:2], SamplingParams(max_tokens=1, prompt_logprobs=0))
    _check(outs, _expected(engine, PROMPTS[:2]), PROMPTS[:2], 0)
    assert all(len(entry) == 1 for o in outs for entry in o.prompt_logprobs[1:])


def test_preemption_recomputes_without_repeating_positions(ckpt):
    engine = tiny_engine(ckpt, skip_tokenizer_init=True, kv_cache_memory_gib=None, block_size=16)
    engine.pool.__init__(12)                         # a deliberately small cache: 12 rows of 16 tokens
    engine.scheduler.pool = engine.pool
    outs = _run(engine, PROMPTS, SamplingParams(max_tokens=30, temperature=0, prompt_logprobs=2))
    assert engine.scheduler.num_preemptions > 0
    _check(outs, _expected(engine, PROMPTS), PROMPTS, 2)


def test_prefix_cache_hits_are_not_taken_by_requests_that_ask(ckpt):
    engine = tiny_engine(ckpt, skip_tokenizer_init=True, enable_prefix_caching=True, block_size=16,
                         prefix_match_unit=16)
    prompt = PROMPTS[4]
    _run(engine, [prompt], SamplingParams(max_tokens=2))
    hits = engine.prefix_cache.stats.hits
    outs = _run(engine, [prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    assert engine.prefix_cache.stats.hits == hits
    _check(outs, _expected(engine, [prompt]), [prompt], 1)
    _run(engine, [prompt], SamplingParams(max_tokens=2))          # the others still hit
    assert engine.prefix_cache.stats.hits == hits + 1


def test_asynchronous_scheduling_and_n(ckpt):
    engine = tiny_engine(ckpt, skip_tokenizer_init=True, async_scheduling=True)
    outs = _run(engine, PROMPTS[:3], SamplingParams(n=2, max_tokens=4, temperature=0, prompt_logprobs=2))
    assert all(len(o.outputs) == 2 for o in outs)
    _check(outs, _expected(engine, PROMPTS[:3]), PROMPTS[:3], 2)


def test_decoded_tokens_with_a_tokenizer(tokenized_checkpoint):
    import k3

    llm = k3.LLM(str(tokenized_checkpoint("kimi-linear-tiny")), dtype="float64", kv_cache_memory_gib=0.02,
                 load_progress=False)
    out = llm.generate(["Hello there"], k3.SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for token, entry in zip(ids[1:], out.prompt_logprobs[1:]):
        assert isinstance(entry[token], Logprob) and entry[token].decoded_token == tok.decode([token])


@pytest.mark.parametrize("value", [-1, 21, 1.5])
def test_prompt_logprobs_range(value):
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
