"""AsyncEngine: concurrent streams, early close aborts and frees rows, refusals raise."""

import asyncio
import time

import pytest

from k3.engine.async_engine import AsyncEngine
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from k3.cli.checkpoint import init_checkpoint

    path = init_checkpoint("k3-tiny", tmp_path_factory.mktemp("async-k3-tiny"), progress=False)
    e = AsyncEngine(LLMEngine(EngineConfig(model=str(path), dtype="float64", kv_cache_memory_gib=0.02,
                                           max_model_len=256, load_progress=False)))
    yield e
    e.shutdown()


async def _collect(engine, request_id, prompt, params):
    last = None
    async for out in engine.generate(request_id, prompt, params):
        last = out
    return last


def test_concurrent_streams_match_sequential(engine):
    params = SamplingParams(max_tokens=6, temperature=0)
    prompts = [[(5 * i + j) % 300 + 1 for j in range(4 + 3 * i)] for i in range(6)]

    async def main():
        together = await asyncio.gather(*[_collect(engine, f"c{i}", p, params) for i, p in enumerate(prompts)])
        alone = [await _collect(engine, f"s{i}", p, params) for i, p in enumerate(prompts)]
        return together, alone

    together, alone = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert engine.stats()["cache_rows_free"] == engine.stats()["cache_rows"]


def test_closing_a_stream_aborts_and_frees(engine):
    start = engine.stats()["cache_rows_free"]

    async def main():
        stream = engine.generate("early", [1, 2, 3, 4, 5], SamplingParams(max_tokens=200, temperature=0))
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(main())
    deadline = time.monotonic() + 5  # the abort is applied before the engine's next step
    while engine.stats()["cache_rows_free"] != start and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats()["cache_rows_free"] == start and engine.stats()["running"] == 0


def test_refused_request_raises_before_streaming(engine):
    async def main():
        async for _ in engine.generate("long", list(range(1, 300)), SamplingParams(max_tokens=2)):
            pass

    with pytest.raises(ValueError, match="context is 256"):
        asyncio.run(main())
