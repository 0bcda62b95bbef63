"""POST /v1/responses for text and function tools: on the canned K3 generation of
test_serve_tools (reasoning, text, two calls) and on the real k3-tiny engine (the same tokens as
the chat route), streaming and not, with the official client; the input items are checked by
the prompt they render (against the chat renderer's prompt of the equivalent messages)."""

from __future__ import annotations

import json

import openai
import pytest

from k3.chat.template import chat_prompt_ids
from k3.serve import build_app

from serve_support import MODEL, LiveServer
from test_serve_tools import WEATHER, CannedEngine

TOOLS = [{"type": "function", "name": "get_weather", "description": "weather of a city", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                                 "parameters": WEATHER}}]


class Recording(CannedEngine):
    def __init__(self, real):
        super().__init__(real)
        self.prompts = []

    async def generate(self, request_id, prompt, params):
        self.prompts.append(list(prompt))
        async for out in super().generate(request_id, prompt, params):
            yield out


@pytest.fixture(scope="module")
def canned(engine):
    return Recording(engine)


@pytest.fixture(scope="module")
def parsing(canned):
    app = build_app(canned, served_model_name=MODEL, enable_auto_tool_choice=True, tool_call_parser="kimi_k3",
                    reasoning_parser="kimi_k3")
    with LiveServer(app) as live:
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _summary(output) -> list:
    """(type, text or call) of each output item, ids left out."""
    out = []
    for item in output:
        item = item if isinstance(item, dict) else item.model_dump()
        if item["type"] == "reasoning":
            out.append(("reasoning", "".join(c["text"] for c in item["content"])))
        elif item["type"] == "message":
            out.append(("message", "".join(c["text"] for c in item["content"])))
        else:
            out.append(("function_call", item["name"], json.loads(item["arguments"])))
    return out


EXPECTED = [("reasoning", "Let me check."), ("message", "Sure."),
            ("function_call", "get_weather", {"city": "Paris", "days": 3}),
            ("function_call", "get_weather", {"city": "Oslo", "days": 3})]


def test_tools_and_reasoning(parsing, canned, engine):
    r = parsing.responses.create(model=MODEL, input="weather in Paris and Oslo?", tools=TOOLS,
                                 instructions="Be brief.")
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert _summary(r.output) == EXPECTED and r.output_text == "Sure."
    calls = [i for i in r.output if i.type == "function_call"]
    assert all(c.call_id.startswith("call_") for c in calls) and calls[0].call_id != calls[1].call_id
    assert r.usage.output_tokens == len(canned.ids) and r.usage.input_tokens == len(canned.prompts[-1])
    expected_prompt = chat_prompt_ids(engine.tokenizer, [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "weather in Paris and Oslo?"}],
                                      tools=CHAT_TOOLS)
    assert canned.prompts[-1] == expected_prompt

    events = list(parsing.responses.create(model=MODEL, input="weather?", tools=TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Sure."
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Let me check."
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 4
    assert _summary(events[-1].response.output) == EXPECTED


def test_input_items_render_as_the_chat_conversation(parsing, canned, engine):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "weather in Paris?"}]},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": '{"temp_c": 11}'},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "11 C."}]},
             {"role": "user", "content": "and Oslo?"}]
    parsing.responses.create(model=MODEL, input=items, tools=TOOLS, reasoning={"effort": "low"})
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 11}'},
                {"role": "assistant", "content": "11 C."}, {"role": "user", "content": "and Oslo?"}]
    assert canned.prompts[-1] == chat_prompt_ids(engine.tokenizer, messages, tools=CHAT_TOOLS, thinking_effort="low")


def test_refusals(parsing):
    for body, param in (({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
                        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
                        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, None)):
        with pytest.raises(openai.BadRequestError) as e:
            parsing.responses.create(model=MODEL, **body)
        assert param is None or (e.value.body["param"] or "").startswith(param), e.value.body


def test_text_on_the_real_engine_matches_chat(client):
    r = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                          max_completion_tokens=4, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 4
    message = chat.choices[0].message
    expected = [("reasoning", message.reasoning_content)] if message.reasoning_content else []
    expected += [("message", message.content)] if message.content else []
    assert _summary(r.output) == expected
