"""Prefill/decode disaggregation at the engine level (float64 k3-tiny, TCP stand-in on
loopback): a producer's prefill + a consumer's decode give one instance's tokens, the pulled
rows equal the producer's byte for byte, a prefix hit on the consumer skips rows, and every
failed transfer (producer gone, expired pin, another prompt's handle) falls back to local
prefill with the same tokens."""

import math

import pytest
import torch

from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams

BLOCK = 16


def _engine(ckpt, **kw):
    return LLMEngine(EngineConfig(model=str(ckpt), dtype="float64", load_progress=False, kv_cache_memory_gib=0.02,
                                  block_size=BLOCK, skip_tokenizer_init=True, **kw))


def _kv(role, **extra):
    return {"kv_connector": "TCPConnector", "kv_role": role, "kv_connector_extra_config": extra}


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    ckpt = tiny_checkpoint("k3-tiny")
    ref = _engine(ckpt)
    producer = _engine(ckpt, kv_transfer_config=_kv("kv_producer"), enable_prefix_caching=True)
    consumer = _engine(ckpt, kv_transfer_config=_kv("kv_consumer", transfer_timeout_s=10),
                       enable_prefix_caching=True)
    yield ref, producer, consumer
    for e in (producer, consumer):
        e.shutdown()


def _run(engine, rid, prompt, params):
    engine.add_request(rid, prompt, params)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                last = out
    return last


def _prompt(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 400, (n,), generator=g).tolist()


def _prefill(producer, rid, prompt, params):
    out = _run(producer, rid, prompt, _with(params, {"do_remote_decode": True}))
    assert out.finished and len(out.outputs[0].token_ids) == 1, out      # max_tokens treated as 1
    return out.kv_transfer_params


def _with(params, kv):
    from dataclasses import replace

    return replace(params, kv_transfer_params=kv)


def _only_cache_holds_rows(engine):
    """No request holds a row: what is used is the prefix cache's (pages and KDA checkpoints)."""
    cache = engine.prefix_cache
    assert engine.pool.num_used == cache.num_cached_rows + cache.num_checkpoint_rows


def _settle(producer):
    """The producer frees confirmed pins between steps."""
    while producer.has_unfinished_requests():
        producer.step()


@pytest.mark.parametrize("n", [5, BLOCK, 3 * BLOCK + 7])
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=7, temperature=0),
                                    SamplingParams(max_tokens=7, temperature=0.9, top_k=20, seed=11)],
                         ids=["greedy", "seeded"])
def test_pd_equals_one_instance(engines, n, params):
    ref, producer, consumer = engines
    prompt = _prompt(n, n)
    expected = _run(ref, f"r{n}", prompt, params).outputs[0].token_ids
    handle = _prefill(producer, f"p{n}", prompt, params)
    assert handle["do_remote_prefill"] and len(handle["rows"]) == math.ceil(n / BLOCK)
    assert handle["first_token"] == expected[0]
    before = consumer.kv_transfer_stats()
    got = _run(consumer, f"c{n}", prompt, _with(params, handle))
    assert got.outputs[0].token_ids == expected
    stats = consumer.kv_transfer_stats()
    assert stats["kv_pulls_total"] == before["kv_pulls_total"] + 1
    assert stats["kv_fallbacks_total"] == before["kv_fallbacks_total"]
    _settle(producer)
    assert producer.kv_transfer_stats()["kv_pinned_rows"] == 0
    _only_cache_holds_rows(consumer)


def test_rows_pulled_byte_for_byte(engines):
    ref, producer, consumer = engines
    prompt = _prompt(101, 2 * BLOCK + 9)
    params = SamplingParams(max_tokens=4, temperature=0)
    handle = _prefill(producer, "bb", prompt, params)
    pinned = producer.kv_transfer_stats()["kv_pinned_rows"]
    assert pinned >= len(handle["rows"]) + 1
    consumer.add_request("bb", prompt, _with(params, handle))
    (pull,) = consumer.kv_consumer.inflight
    consumer.kv_consumer.wait()
    assert pull.future.exception() is None
    remote = handle["rows"] + [handle["state_row"]]
    assert [r for r, _ in pull.pairs] == remote                          # no prefix hit: every row moves
    for r, local in pull.pairs:
        assert torch.equal(consumer.cache.backing[local], producer.cache.backing[r]), (r, local)
    assert not torch.all(producer.cache.backing[handle["state_row"]] == 0xFF)      # a written row, not poison
    expected = _run(ref, "bb", prompt, params).outputs[0].token_ids
    done = None
    while consumer.has_unfinished_requests():
        done = next((o for o in consumer.step() if o.finished), done)
    assert done.outputs[0].token_ids == expected
    _settle(producer)
    assert producer.kv_transfer_stats()["kv_pinned_rows"] == pinned - len(remote)


def test_prefix_hit_on_consumer_skips_rows(engines):
    ref, producer, consumer = engines
    shared = _prompt(202, 3 * BLOCK)
    first, second = shared + _prompt(203, 10), shared + _prompt(204, 21)
    params = SamplingParams(max_tokens=5, temperature=0)
    for i, prompt in enumerate((first, second)):
        expected = _run(ref, f"h{i}", prompt, params).outputs[0].token_ids
        handle = _prefill(producer, f"h{i}", prompt, params)
        before = consumer.kv_transfer_stats()
        assert _run(consumer, f"h{i}", prompt, _with(params, handle)).outputs[0].token_ids == expected
        after = consumer.kv_transfer_stats()
        skipped = after["kv_rows_skipped_total"] - before["kv_rows_skipped_total"]
        pulled = after["kv_rows_pulled_total"] - before["kv_rows_pulled_total"]
        assert skipped == (0 if i == 0 else 3)                          # the shared blocks stay home
        assert pulled == math.ceil(len(prompt) / BLOCK) - skipped + 1   # + the KDA state row
    _settle(producer)


def test_unreachable_producer_falls_back(engines):
    ref, producer, consumer = engines
    prompt = _prompt(303, 2 * BLOCK + 3)
    params = SamplingParams(max_tokens=6, temperature=0)
    expected = _run(ref, "u", prompt, params).outputs[0].token_ids
    handle = _prefill(producer, "u", prompt, params)
    dead = dict(handle, remote_data="127.0.0.1:1", remote_control="127.0.0.1:1")
    before = consumer.kv_transfer_stats()["kv_fallbacks_total"]
    assert _run(consumer, "u", prompt, _with(params, dead)).outputs[0].token_ids == expected
    assert consumer.kv_transfer_stats()["kv_fallbacks_total"] == before + 1
    # the real handle still works, and another prompt's handle is refused up front
    other = _prompt(304, 2 * BLOCK + 3)
    assert _run(consumer, "o", other, _with(params, handle)).outputs[0].token_ids == \
        _run(ref, "o", other, params).outputs[0].token_ids
    assert consumer.kv_transfer_stats()["kv_fallbacks_total"] == before + 1    # refused in start: no pull
    assert _run(consumer, "u2", prompt, _with(params, handle)).outputs[0].token_ids == expected
    _settle(producer)
    _only_cache_holds_rows(consumer)


def test_expired_pin_falls_back(tiny_checkpoint, engines):
    ref, _, consumer = engines
    producer = _engine(tiny_checkpoint("k3-tiny"), kv_transfer_config=_kv("kv_producer", pin_timeout_s=0.05))
    try:
        prompt = _prompt(404, BLOCK + 2)
        params = SamplingParams(max_tokens=5, temperature=0)
        handle = _prefill(producer, "e", prompt, params)
        import time

        time.sleep(0.1)
        assert producer.has_unfinished_requests()          # an expired pin to free
        producer.step()
        assert producer.kv_transfer_stats()["kv_expired_total"] == 1
        assert producer.pool.num_free == producer.pool.num_rows
        before = consumer.kv_transfer_stats()["kv_fallbacks_total"]
        assert _run(consumer, "e", prompt, _with(params, handle)).outputs[0].token_ids == \
            _run(ref, "e", prompt, params).outputs[0].token_ids
        assert consumer.kv_transfer_stats()["kv_fallbacks_total"] == before + 1
    finally:
        producer.shutdown()


def test_abort_during_pull_frees_rows_after_it(engines):
    _, producer, consumer = engines
    prompt = _prompt(505, 3 * BLOCK + 1)
    params = SamplingParams(max_tokens=5, temperature=0)
    handle = _prefill(producer, "ab", prompt, params)
    consumer.add_request("ab", prompt, _with(params, handle))
    (pull,) = consumer.kv_consumer.inflight
    consumer.abort_request("ab")                        # the pull thread may still be writing its rows
    assert consumer.pool.num_used >= len(pull.own)      # so they are not free yet
    while consumer.has_unfinished_requests():
        assert consumer.step() == []
    _only_cache_holds_rows(consumer)
    _settle(producer)
    assert producer.kv_transfer_stats()["kv_pinned_rows"] == 0       # the pull still confirmed
