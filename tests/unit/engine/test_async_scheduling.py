"""Asynchronous scheduling (EngineConfig.async_scheduling): the next decode step is launched
before the host reads the running step's tokens, with its input ids copied on the device. Every
request must get exactly the outputs of synchronous scheduling (tokens, logprobs, text, finish
reasons), its rows must be free at the end, and the lookahead must actually run."""

import pytest

from engines import tiny_engine
from k3.engine.params import SamplingParams


@pytest.fixture(scope="module")
def ckpt(tokenized_checkpoint):
    return tokenized_checkpoint("k3-tiny")


_engine = tiny_engine


PROMPTS = [[(11 * i + 5 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((20, 6, 33, 9, 14, 8))]
PARAMS = [
    SamplingParams(max_tokens=9, temperature=0, logprobs=2),
    SamplingParams(max_tokens=7, temperature=0.9, seed=3),                       # seeded draws
    SamplingParams(max_tokens=11, temperature=0.7, top_p=0.8, seed=5, n=2),      # two children
    SamplingParams(max_tokens=1, temperature=0),                                 # done at its first token
    SamplingParams(max_tokens=10, temperature=0, min_tokens=4, repetition_penalty=1.3),   # sync-only needs
    SamplingParams(max_tokens=8, temperature=0.8, seed=9, logit_bias={7: 4.0, 12: -100.0}),   # bias in lookahead
]


def _summary(out):
    return [(c.token_ids, c.cumulative_logprob, c.text, c.finish_reason, c.stop_reason, c.logprobs)
            for c in out.outputs]


def _run(engine, requests, *, arrivals=None):
    """Run to completion; arrivals: {step index: [(id, prompt, params)]} added before that step."""
    done, steps = {}, 0
    pending = dict(arrivals or {})
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests() or pending:
        for rid, prompt, params in pending.pop(steps, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = _summary(out)
        steps += 1
    return done


def _requests(prompts=PROMPTS, params=PARAMS):
    return [(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params))]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_async_scheduling_gives_the_outputs_of_synchronous_scheduling(ckpt, prefix_caching):
    sync = _run(_engine(ckpt, enable_prefix_caching=prefix_caching), _requests())
    engine = _engine(ckpt, async_scheduling=True, enable_prefix_caching=prefix_caching)
    free = engine.pool.num_free
    assert _run(engine, _requests()) == sync
    assert engine.num_lookahead_steps > 5                      # the lookahead ran, not only the fallback
    if not prefix_caching:
        assert engine.pool.num_free == free


def test_requests_arriving_and_stopping_mid_run(ckpt):
    """New requests arrive while decodes run (the lookahead gives way to the scheduler), and
    requests stop on a stop string and on a stop token (their lookahead token is dropped)."""
    base = SamplingParams(max_tokens=12, temperature=0)
    probe = _run(_engine(ckpt), [("p", PROMPTS[0], base), ("q", PROMPTS[2], base)])
    stop_token = probe["p"][0][0][5]                          # the 6th greedy token of prompt 0
    text = probe["q"][0][2]                                   # prompt 2's greedy text
    assert len(text) >= 5, text
    requests = [("a", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_token])),
                ("b", PROMPTS[2], SamplingParams(max_tokens=12, temperature=0, stop=[text[2:4]]))]
    arrivals = {3: [("c", PROMPTS[1], base)], 6: [("d", PROMPTS[3], SamplingParams(max_tokens=5, temperature=0.8,
                                                                                 seed=1))]}
    sync = _run(_engine(ckpt), requests, arrivals=arrivals)
    engine = _engine(ckpt, async_scheduling=True)
    free = engine.pool.num_free
    assert _run(engine, requests, arrivals=arrivals) == sync
    assert sync["a"][0][3] == "stop" and len(sync["a"][0][0]) == 6 and sync["b"][0][3] == "stop"
    assert engine.num_lookahead_steps > 0 and engine.pool.num_free == free


def test_abort_while_a_lookahead_runs_frees_rows_and_keeps_the_others(ckpt):
    params = SamplingParams(max_tokens=10, temperature=0)
    want = _run(_engine(ckpt), [("keep", PROMPTS[0], params)])
    engine = _engine(ckpt, async_scheduling=True)
    free = engine.pool.num_free
    engine.add_request("keep", PROMPTS[0], params)
    engine.add_request("drop", PROMPTS[2], params)
    done = {}
    for _ in range(4):                                        # prefill, then decodes with a lookahead in flight
        for out in engine.step():
            done[out.request_id] = out
    assert engine.strategy.pending is not None
    engine.abort_request("drop")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert _summary(done["keep"]) == want["keep"] and engine.pool.num_free == free


def test_async_scheduling_refuses_speculation(ckpt):
    with pytest.raises(ValueError, match="async_scheduling needs"):
        _engine(ckpt, async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_the_serve_flag_reaches_the_engine(ckpt):
    import argparse

    from k3.cli import serve
    from k3.cli.common import CliError

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", str(ckpt), "--async-scheduling", "--kv-cache-memory", "0.02"])
    serve.apply_defaults(args, {})
    assert serve.build_engine(args).config.async_scheduling
    args = parser.parse_args(["--model", str(ckpt), "--no-async-scheduling", "--kv-cache-memory", "0.02"])
    serve.apply_defaults(args, {})
    assert serve.build_engine(args).config.async_scheduling is False
    args = parser.parse_args(["--model", str(ckpt), "--kv-cache-memory", "0.02"])
    serve.apply_defaults(args, {})
    engine = serve.build_engine(args)
    assert engine.config.async_scheduling is None and not engine.async_scheduling   # the CPU captures no graphs
    args = parser.parse_args(["--model", str(ckpt), "--async-scheduling", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 2}'])
    serve.apply_defaults(args, {})
    with pytest.raises(CliError, match="async_scheduling needs"):
        serve.build_engine(args)
