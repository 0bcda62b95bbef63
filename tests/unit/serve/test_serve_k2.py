"""A Kimi-Linear checkpoint (K2 chat format): chat works with the K2 template, output is plain
content, and the kimi_k3 parsers are refused at startup."""

from __future__ import annotations

import openai
import pytest

from k3.engine.async_engine import AsyncEngine
from k3.engine.engine import EngineConfig, LLMEngine
from k3.serve import build_app

from serve_support import LiveServer, wait_rows_free


@pytest.fixture(scope="module")
def k2_engine(tmp_path_factory):
    from k3.cli.checkpoint import init_checkpoint

    path = init_checkpoint("kimi-linear-tiny", tmp_path_factory.mktemp("serve-kimi-linear"), progress=False)
    e = AsyncEngine(LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory_gib=0.02,
                                           max_model_len=512, load_progress=False)))
    yield e
    e.shutdown()


def test_k2_chat_is_plain_content(k2_engine):
    assert k2_engine.tokenizer.flavor == "k2"
    with LiveServer(build_app(k2_engine, served_model_name="kimi-linear")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="kimi-linear", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, temperature=0, logprobs=True)
        choice = r.choices[0]
        assert getattr(choice.message, "reasoning_content", None) is None and choice.finish_reason == "length"
        names = set(k2_engine.tokenizer.special_tokens)  # skipped from K2 content by default
        text = bytes(b for item in choice.logprobs.content if item.token not in names for b in item.bytes)
        assert choice.message.content == text.decode("utf-8", "replace")
        chunks = list(client.chat.completions.create(model="kimi-linear", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    stats = wait_rows_free(k2_engine)
    assert stats["cache_rows_free"] == stats["cache_rows"]


def test_k3_parsers_are_refused_for_k2(k2_engine):
    with pytest.raises(ValueError, match="K2 chat format"):
        build_app(k2_engine, served_model_name="x", reasoning_parser="kimi_k3")
    with pytest.raises(ValueError, match="needs a tool call parser"):
        build_app(k2_engine, served_model_name="x", enable_auto_tool_choice=True)
