"""Serve-tier fixtures: one k3-tiny AsyncEngine for the session, servers over it on loopback,
and the check that every test gives every cache row back."""

from __future__ import annotations

import openai
import pytest

from k3.engine.async_engine import AsyncEngine
from k3.engine.engine import EngineConfig, LLMEngine
from k3.serve import build_app

from serve_support import MAX_MODEL_LEN, MODEL, LiveServer, wait_rows_free


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from k3.cli.checkpoint import init_checkpoint

    return init_checkpoint("k3-tiny", tmp_path_factory.mktemp("serve-k3-tiny"), progress=False)


@pytest.fixture(scope="session")
def engine(checkpoint):
    e = AsyncEngine(LLMEngine(EngineConfig(model=str(checkpoint), dtype="float32", kv_cache_memory_gib=0.05,
                                           max_model_len=MAX_MODEL_LEN, load_progress=False)))
    yield e
    e.shutdown()


@pytest.fixture(autouse=True)
def no_leaked_rows(request):
    """Every serve test ends with all cache rows free (when it used the shared engine)."""
    yield
    if "engine" in request.fixturenames:
        s = wait_rows_free(request.getfixturevalue("engine"))
        assert s["cache_rows_free"] == s["cache_rows"], f"leaked cache rows: {s}"
        assert s["running"] == 0 and s["waiting"] == 0, s


@pytest.fixture(scope="session")
def server(engine):
    """The full-featured server: K3 reasoning and tool parsers on."""
    app = build_app(engine, served_model_name=[MODEL, "alias"], enable_auto_tool_choice=True,
                    tool_call_parser="kimi_k3", reasoning_parser="kimi_k3")
    with LiveServer(app) as live:
        yield live


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
