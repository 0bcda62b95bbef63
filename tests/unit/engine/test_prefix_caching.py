"""Prefix caching is exact: greedy outputs with and without it are identical (float64), for
shared prefixes ending inside a block, at a block boundary, at a unit boundary, inside the
unique suffix, and after eviction; a hit never resumes the KDA recurrence from a wrong state."""

import pytest

from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams

BLOCK, UNIT = 64, 16
GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from k3.cli.checkpoint import init_checkpoint

    return init_checkpoint("k3.1-pro-tiny", tmp_path_factory.mktemp("prefix-k3.1-pro-tiny"), progress=False)


def _engine(ckpt, caching, **kw):
    return LLMEngine(EngineConfig(model=str(ckpt), dtype="float64", load_progress=False, kv_cache_memory_gib=0.02,
                                  block_size=BLOCK, enable_prefix_caching=caching, prefix_match_unit=UNIT, **kw))


def _generate(engine, prompts, params=GREEDY):
    out = []
    for i, p in enumerate(prompts):          # one after another, so later prompts can hit
        engine.add_request(f"q{engine.stats['requests_total']}", p, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out.append(o.outputs[0].token_ids)
    return out


def _tokens(seed, n):
    return [(seed * 31 + 7 * i + (i * i) % 13) % 380 + 1 for i in range(n)]


BASE = _tokens(1, 150)
CASES = {
    "inside a block": [BASE[:100], BASE[:90] + _tokens(2, 20)],
    "at a block boundary": [BASE[:140], BASE[:128] + _tokens(3, 9)],
    "at a unit boundary": [BASE[:100], BASE[:80] + _tokens(4, 30)],
    "inside the unique suffix": [BASE[:150], BASE[:150] + _tokens(5, 7)],
    "identical prompts": [BASE[:77], BASE[:77]],
}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_equal_with_and_without_caching(ckpt, case):
    prompts = CASES[case]
    expected = _generate(_engine(ckpt, False), prompts)
    engine = _engine(ckpt, True, kda_checkpoint_interval=UNIT)       # checkpoints at every unit
    assert _generate(engine, prompts) == expected
    stats = engine.prefix_cache_stats()
    assert stats["prefix_cache_queries_total"] == 2 and stats["prefix_cache_hits_total"] >= 1
    assert stats["prefix_cache_reused_tokens_total"] % UNIT == 0 and stats["prefix_cache_reused_tokens_total"] > 0


def test_hit_is_clamped_to_the_deepest_checkpoint(ckpt):
    """After a 140-token prompt, attention pages cover 9 units (the prompt and 4 generated
    tokens) but the only KDA checkpoint is at the prompt's last full unit, 128: a follow-up
    sharing all 144 tokens reuses 128, never 144; one sharing 120 tokens reuses nothing."""
    engine = _engine(ckpt, True)
    first = _generate(engine, [BASE[:140]])[0]
    assert len(engine.prefix_cache.units) == 9 and engine.prefix_cache.num_checkpoint_rows == 1
    follow_up, diverging = BASE[:140] + first + _tokens(9, 10), BASE[:120] + _tokens(9, 10)
    expected = _generate(_engine(ckpt, False), [follow_up, diverging])
    before = engine.prefix_cache.stats.reused_tokens
    assert _generate(engine, [follow_up]) == expected[:1]
    assert engine.prefix_cache.stats.reused_tokens - before == 128
    before = engine.prefix_cache.stats.reused_tokens
    assert _generate(engine, [diverging]) == expected[1:]
    assert engine.prefix_cache.stats.reused_tokens - before == 0


def test_no_checkpoint_means_no_reuse_for_a_hybrid(ckpt):
    engine = _engine(ckpt, True)
    cache = engine.prefix_cache
    _generate(engine, [BASE[:100]])
    cache.checkpoints.clear()          # pages cached, checkpoint gone (e.g. evicted separately)
    expected = _generate(_engine(ckpt, False), [BASE[:100] + _tokens(8, 5)])
    assert _generate(engine, [BASE[:100] + _tokens(8, 5)]) == expected
    assert cache.stats.reused_tokens == 0


def test_eviction_keeps_outputs_exact_and_frees_rows(ckpt):
    engine = _engine(ckpt, True)
    prompts = [_tokens(s, 120) for s in range(10, 16)] + [_tokens(10, 120) + _tokens(20, 10)]
    expected = _generate(_engine(ckpt, False), prompts)
    engine.pool.__init__(14)                   # a small pool forces eviction
    engine.scheduler.pool = engine.prefix_cache.pool = engine.pool
    assert _generate(engine, prompts) == expected
    engine.prefix_cache.evict(10 ** 6)
    assert engine.pool.num_free == 14 and not engine.prefix_cache.units and not engine.prefix_cache.checkpoints


def test_multi_turn_chat_reuses_the_conversation(ckpt):
    engine = _engine(ckpt, True)
    tok = engine.tokenizer
    from k3.chat.template import chat_prompt_ids

    history = [{"role": "system", "content": "You are a careful assistant. " * 6}]
    reused = []
    for turn in range(3):
        history.append({"role": "user", "content": f"Question {turn}: tell me about Kimi K3 layer {turn}."})
        ids = chat_prompt_ids(tok, history, thinking=False)
        before = engine.prefix_cache.stats.reused_tokens
        out = _generate(engine, [ids], SamplingParams(max_tokens=4, temperature=0))[0]
        reused.append(engine.prefix_cache.stats.reused_tokens - before)
        history.append({"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)})
    assert reused[0] == 0 and reused[1] > 0 and reused[2] > reused[1]


def test_a_chain_through_a_copied_partial_block_reads_the_copy(ckpt):
    """A caches 2 units of block 0; B extends them in its own copy of that row and caches units
    2-5 there; C, sharing 90 tokens of B, must read block 0 from B's copy (the first rows of
    the units differ), not from A's row."""
    a = BASE[:40]
    b = a + _tokens(7, 60)
    c = b[:90] + _tokens(8, 10)
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = _generate(_engine(ckpt, False), [a, b, c], params)
    engine = _engine(ckpt, True, kda_checkpoint_interval=UNIT)
    assert _generate(engine, [a, b, c], params) == expected
    assert engine.prefix_cache.stats.hits == 2


def test_a_shallower_checkpoint_survives_eviction_and_is_reused(ckpt):
    engine = _engine(ckpt, True, kda_checkpoint_interval=32)
    x = _tokens(10, 120)
    follow_up = x + _tokens(20, 10)
    expected = _generate(_engine(ckpt, False), [x, follow_up])
    assert _generate(engine, [x]) == expected[:1]
    deepest = max(u.end for u in engine.prefix_cache.units.values() if u.key in engine.prefix_cache.checkpoints)
    assert engine.prefix_cache.evict(1) >= 1                  # drops the deepest leaf (and its checkpoint)
    before = engine.prefix_cache.stats.reused_tokens
    assert _generate(engine, [follow_up]) == expected[1:]
    reused = engine.prefix_cache.stats.reused_tokens - before
    assert 0 < reused < deepest and reused % 32 == 0


def test_evictable_rows_are_the_rows_only_the_cache_holds(ckpt):
    """`prefix_cache_evictable_rows` (what vLLM's KV-cache usage counts as free): every cached
    row while idle; while a request runs on a hit, the rows it shares are not evictable, and
    evicting everything frees exactly the evictable count."""
    engine = _engine(ckpt, True, kda_checkpoint_interval=UNIT)
    _generate(engine, [BASE[:140]])
    idle = engine.prefix_cache_stats()
    assert idle["prefix_cache_evictable_rows"] == idle["prefix_cache_rows"] + idle["prefix_cache_checkpoint_rows"] > 0
    engine.add_request("hit", BASE[:140] + _tokens(6, 5), GREEDY)
    engine.step()                                           # prefilled on the hit: shares the cached rows
    busy = engine.prefix_cache_stats()
    assert engine.prefix_cache_stats()["prefix_cache_hits_total"] == 1
    assert busy["prefix_cache_evictable_rows"] < idle["prefix_cache_evictable_rows"]
    free_before = engine.pool.num_free
    freed = engine.prefix_cache.evict(engine.pool.num_rows)
    assert freed == engine.pool.num_free - free_before == busy["prefix_cache_evictable_rows"]
