"""Structured outputs through the server (issue 29): response_format json_schema and
json_object on chat (the K3 response channel constrained, the message closed after it),
guided_* and structured_outputs on completions, and 400s for constraints that cannot be
compiled or that clash."""

import json
import re

try:
    import httpx2 as httpx
except ImportError:
    import httpx
import jsonschema
import pytest

from serve_support import MODEL

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["city", "n", "tags"], "additionalProperties": False}
INSTRUCT = {"chat_template_kwargs": {"thinking": False}}


def _fmt():
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


def test_chat_json_schema_validates_and_streaming_agrees(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Now greedy"}], response_format=_fmt(),
                  max_tokens=64, temperature=0, extra_body=INSTRUCT)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop", whole
    jsonschema.validate(json.loads(whole.message.content), SCHEMA)
    parts, reasons = [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(parts) == whole.message.content and reasons[-1] == whole.finish_reason == "stop"


def test_chat_json_object(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Any JSON"}],
                                       response_format={"type": "json_object"}, max_tokens=24, temperature=0,
                                       extra_body=INSTRUCT)
    c = r.choices[0]
    if c.finish_reason == "stop":        # an unbounded object may run past max_tokens; what came must parse
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.message.content.startswith("{")


def test_completions_guided_fields(client):
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, temperature=1.0, seed=1, n=3,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert all(c.text in ("left", "right") and c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=12, temperature=1.0, seed=2,
                                  extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}})
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=80, temperature=1.0, seed=3,
                                  extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
])
def test_bad_constraints_are_400_with_an_openai_error(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, **body},
                   timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "days", "unit"]}}},
    {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "items": {"type": "number", "minimum": 0,
                                                                          "maximum": 9}, "maxItems": 3}},
        "required": ["xs"]}}},
]
SCHEMAS_BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_tool_choice_always_yields_a_valid_call(client, choice):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather or sum?"}],
                                       tools=TOOLS, tool_choice=choice, max_tokens=96, temperature=1.0, seed=5,
                                       extra_body=INSTRUCT)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
    call = c.message.tool_calls[0].function
    if isinstance(choice, dict):
        assert call.name == "add"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS_BY_NAME[call.name])


@pytest.mark.parametrize("strict", [True, False])
def test_auto_tool_choice_compiles_strict_tools_only(server, strict):
    """Under tool_choice auto a strict tool's schema becomes the call grammar (compiled with the
    request: one that cannot compile is a 400 naming `tools`); without strict the tools are only
    rendered into the prompt, as before."""
    tool = {"type": "function", "function": {"name": "f", "strict": strict, "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "(("}}, "required": ["s"]}}}
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": "auto",
        "max_tokens": 4, **INSTRUCT}, timeout=60)
    if strict:
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    else:
        assert r.status_code == 200, r.text
