"""Tool calls and reasoning through the server's K3 parser integration, on a canned generation:
an engine whose every request "generates" one fixed XTML text, token by token."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from k3.engine.request import CompletionOutput, RequestOutput
from k3.serve import build_app

from serve_support import MODEL, LiveServer

CALL = ('<|open|>call tool="get_weather" index="{i}"<|sep|><|open|>argument key="city" type="string"<|sep|>{city}'
        '<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
        '<|close|>call<|sep|>')
TEXT = ("Let me check.<|close|>think<|sep|><|open|>response<|sep|>Sure.<|close|>response<|sep|><|open|>tools<|sep|>"
        + CALL.format(i=1, city="Paris") + CALL.format(i=2, city="Oslo")
        + "<|close|>tools<|sep|><|close|>message<|sep|>")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "number"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                            "parameters": WEATHER}}]
USER = [{"role": "user", "content": "weather in Paris and Oslo?"}]


class CannedEngine:
    """The AsyncEngine interface (tokenizer, limits, stats from a real engine), generating TEXT."""

    def __init__(self, real):
        self.real, self.engine, self.tokenizer, self.dead = real, real.engine, real.tokenizer, None
        self.ids = self.tokenizer.encode(TEXT, allow_special=True)
        self.params = []

    def stats(self):
        return self.real.stats()

    async def generate(self, request_id, prompt, params):
        self.params.append(params)
        for k in range(1, len(self.ids) + 1):
            await asyncio.sleep(0)
            done = k == len(self.ids)
            text = self.tokenizer.decode(self.ids[:k], skip_special_tokens=params.skip_special_tokens)
            outputs = [CompletionOutput(index=i, text=text, token_ids=self.ids[:k], cumulative_logprob=None,
                                        logprobs=None, finish_reason="stop" if done else None,
                                        stop_reason=self.tokenizer.eos_ids[0] if done else None)
                       for i in range(params.n)]
            yield RequestOutput(request_id, None, list(prompt), outputs, done)


@pytest.fixture(scope="module")
def canned(engine):
    return CannedEngine(engine)


def _client(app):
    server = LiveServer(app).__enter__()
    return server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def parsing(canned):
    server, client = _client(build_app(canned, served_model_name=MODEL, enable_auto_tool_choice=True,
                                       tool_call_parser="kimi_k3", reasoning_parser="kimi_k3"))
    yield client
    server.__exit__(None, None, None)


@pytest.fixture(scope="module")
def plain(canned):
    server, client = _client(build_app(canned, served_model_name=MODEL))
    yield client
    server.__exit__(None, None, None)


def test_tool_calls_non_streaming(parsing, canned):
    r = parsing.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
    choice = r.choices[0]
    assert canned.params[-1].skip_special_tokens is False  # the parser must see the markers
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "Let me check." and choice.message.content == "Sure."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris", "days": 3},
                                                                 {"city": "Oslo", "days": 3}]
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


def test_tool_calls_streaming(parsing, canned):
    chunks = list(parsing.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="auto",
                                                  stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Let me check."
    assert "".join(d.content or "" for d in deltas) == "Sure."
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [c.index for c in calls] == [0, 1]  # each call arrives whole, once its close marker is seen
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Oslo"]
    assert all(c.id and c.type == "function" and c.function.name == "get_weather" for c in calls)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens == len(canned.ids)


def test_n_streams_tool_calls_per_choice(parsing):
    chunks = list(parsing.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, n=2, stream=True))
    for index in (0, 1):
        calls = [tc for c in chunks for ch in c.choices if ch.index == index for tc in (ch.delta.tool_calls or [])]
        assert [c.index for c in calls] == [0, 1]


@pytest.mark.parametrize("options", [{}, {"tools": TOOLS, "tool_choice": "none"}], ids=["no-tools", "tool-choice-none"])
def test_calls_stay_content_without_tool_parsing(parsing, options):
    r = parsing.chat.completions.create(model=MODEL, messages=USER, **options)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content.startswith("Sure.<|open|>tools<|sep|><|open|>call tool=\"get_weather\"")


def test_without_parsers_everything_is_content(plain):
    r = plain.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
    message = r.choices[0].message
    assert getattr(message, "reasoning_content", None) is None and not message.tool_calls
    assert message.content.startswith("Let me check.<|close|>think<|sep|>Sure.<|open|>tools<|sep|>")
    assert r.choices[0].finish_reason == "stop"


def test_tool_results_round_trip(parsing):
    auto = parsing.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
    first = auto.choices[0].message
    history = USER + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 11})} for call in first.tool_calls]
    r = parsing.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert r.choices[0].finish_reason == "tool_calls"
    named = parsing.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    # The named choice is rendered as the template's one-shot tool-choice message (not enforced).
    assert named.usage.prompt_tokens > auto.usage.prompt_tokens and named.choices[0].message.tool_calls
