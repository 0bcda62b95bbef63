"""K3 output parsing on hand-written outputs. ``check`` also asserts that char-by-char and random
streaming splits give the same result as the non-streaming parse."""

import json

import pytest
from chat_cases import (
    CALL_CLOSE, END_OF_MSG, MESSAGE_CLOSE, RESPONSE_CLOSE, RESPONSE_OPEN, TAIL, THINK_CLOSE, THINK_OPEN,
    TOOLS_CLOSE, TOOLS_OPEN, answer, arg, call, check, open_tag, tools,
)

from k3.chat import ContentDelta, K3OutputParser, ReasoningDelta, ToolCall, is_reasoning_end


def test_plain_answer_instruct_mode():
    got = check("Hello, world." + RESPONSE_CLOSE + TAIL, thinking=False)
    assert (got.reasoning, got.content, got.tool_calls) == ("", "Hello, world.", [])


def test_thinking_then_answer():
    got = check(answer("Let me think.\n", "The answer is 42."))
    assert (got.reasoning, got.content, got.tool_calls) == ("Let me think.\n", "The answer is 42.", [])


def test_empty_think():
    got = check(answer("", "Hi"))
    assert (got.reasoning, got.content) == ("", "Hi")


def test_echoed_think_open_is_dropped_but_a_later_one_is_text():
    assert check(THINK_OPEN + "r" + THINK_CLOSE + "a").reasoning == "r"
    got = check("about " + THINK_OPEN + " and " + THINK_CLOSE + "a")
    assert (got.reasoning, got.content) == ("about " + THINK_OPEN + " and ", "a")


def test_unclosed_think_is_all_reasoning():
    got = check("still thinking <|open|>response<|sep|>x")
    assert (got.reasoning, got.content) == ("still thinking <|open|>response<|sep|>x", "")


def test_response_open_at_offset_0_means_no_thinking():
    got = check(RESPONSE_OPEN + "direct" + RESPONSE_CLOSE + TAIL)
    assert (got.reasoning, got.content) == ("", "direct")


def test_thinking_disabled_keeps_think_markers_as_text():
    got = check("a" + THINK_CLOSE + "b" + RESPONSE_CLOSE, thinking=False)
    assert (got.reasoning, got.content) == ("", "a" + THINK_CLOSE + "b")


def test_prompt_without_think_prefix():
    got = check(THINK_OPEN + "r" + THINK_CLOSE + RESPONSE_OPEN + "a" + RESPONSE_CLOSE, starts_in_reasoning=False)
    assert (got.reasoning, got.content) == ("r", "a")
    assert check("plain", starts_in_reasoning=False).content == "plain"


def test_multiple_calls_with_every_argument_type():
    text = answer("need tools", "Checking.",
                  call("run", arg("code", "string", 'print("hi")\nx = \'y\' & z'), arg("n", "number", "3"),
                       arg("f", "number", "-2.5e3"), arg("ok", "boolean", "false"), arg("none", "null", "null"),
                       arg("obj", "object", '{"a": [1, {"b": null}]}'), arg("arr", "array", '["x", 2, true]')),
                  call("noargs", index=2))
    got = check(text)
    assert got.content == "Checking."
    assert [(c.index, c.id, c.name) for c in got.tool_calls] == [(0, "call_0", "run"), (1, "call_1", "noargs")]
    assert json.loads(got.tool_calls[0].arguments) == {
        "code": 'print("hi")\nx = \'y\' & z', "n": 3, "f": -2500.0, "ok": False, "none": None,
        "obj": {"a": [1, {"b": None}]}, "arr": ["x", 2, True]}
    assert got.tool_calls[1].arguments == "{}"


def test_call_followed_by_more_content_and_blank_gaps():
    text = (RESPONSE_OPEN + "before" + RESPONSE_CLOSE + TOOLS_OPEN + "\n  " + call("a") + "\n" + call("b", index=2)
            + "\n" + TOOLS_CLOSE + "after" + TAIL)
    got = check(text, starts_in_reasoning=False)
    assert [c.name for c in got.tool_calls] == ["a", "b"]
    assert got.content == "beforeafter"


def test_non_blank_text_between_calls_is_content():
    got = check(TOOLS_OPEN + " note: " + call("a") + TOOLS_CLOSE, thinking=False)
    assert (got.content, [c.name for c in got.tool_calls]) == (" note: ", ["a"])


BAD_CALLS = {
    "unclosed argument": open_tag("call", {"tool": "f"}) + open_tag("argument", {"key": "k", "type": "string"})
    + "v" + CALL_CLOSE,
    "unknown tag": call("f", open_tag("weird") + "x" + "<|close|>weird<|sep|>"),
    "bad JSON": call("f", arg("n", "number", "12,")),
    "NaN": call("f", arg("n", "number", "NaN")),
    "no tool name": open_tag("call", {"index": 1}) + CALL_CLOSE,
    "no key": call("f", open_tag("argument", {"type": "string"}) + "v<|close|>argument<|sep|>"),
    "text between arguments": call("f", arg("a", "string", "1") + "junk" + arg("b", "string", "2")),
    "argument opened twice": call("f", open_tag("argument", {"key": "a", "type": "string"}) + "1"
                                  + arg("b", "string", "2")),
}


@pytest.mark.parametrize("bad", BAD_CALLS, ids=list(BAD_CALLS))
def test_malformed_call_degrades_to_content_and_loses_nothing(bad):
    good = call("ok", arg("x", "number", "1"), index=2)
    got = check(RESPONSE_OPEN + "Hi" + RESPONSE_CLOSE + TOOLS_OPEN + BAD_CALLS[bad] + good + TOOLS_CLOSE + TAIL)
    assert got.content == "Hi" + BAD_CALLS[bad]
    assert [(c.index, c.name, c.arguments) for c in got.tool_calls] == [(0, "ok", '{"x": 1}')]


def test_call_cut_off_by_the_next_call_or_the_end_of_the_channel():
    half = open_tag("call", {"tool": "list"}) + arg("path", "string", ".")
    got = check(TOOLS_OPEN + half + call("rm", arg("path", "string", "/tmp/x")) + TOOLS_CLOSE, thinking=False)
    assert (got.content, [c.name for c in got.tool_calls]) == (half, ["rm"])
    got = check(TOOLS_OPEN + half + TOOLS_CLOSE + "tail", thinking=False)
    assert (got.content, got.tool_calls) == (half + "tail", [])
    got = check(TOOLS_OPEN + call("a") + MESSAGE_CLOSE + END_OF_MSG, thinking=False)  # tools never closed
    assert (got.content, [c.name for c in got.tool_calls]) == ("", ["a"])


@pytest.mark.parametrize("cut", [1, 5, 9, 14, 18])
def test_truncated_mid_marker_keeps_the_text(cut):
    text = "reasoning" + THINK_CLOSE[:cut]
    assert check(text).reasoning == text
    text = "answer" + RESPONSE_CLOSE[:cut]
    assert check(text, thinking=False).content == text


def test_truncated_mid_call_becomes_content():
    partial = open_tag("call", {"tool": "f", "index": 1}) + open_tag("argument", {"key": "a", "type": "string"}) + "va"
    got = check("r" + THINK_CLOSE + TOOLS_OPEN + call("done") + partial)
    assert (got.reasoning, got.content, [c.name for c in got.tool_calls]) == ("r", partial, ["done"])


def test_markers_nested_in_a_string_argument():
    # Markers other than argument/call closes stay inside a string value, raw.
    inner = "<|open|>b<|sep|>bold<|close|>b<|sep|> " + RESPONSE_OPEN
    got = check(TOOLS_OPEN + call("w", arg("html", "string", inner)) + TOOLS_CLOSE, thinking=False)
    assert json.loads(got.tool_calls[0].arguments) == {"html": inner}
    # Documented limitation: a literal <|close|>argument<|sep|> (or <|close|>call<|sep|>) in a value ends
    # it early; the leftover makes the call malformed, so it is passed on as content, verbatim.
    for marker in ("<|close|>argument<|sep|>", CALL_CLOSE):
        bad = call("w", arg("s", "string", "x" + marker + "y"))
        got = check(TOOLS_OPEN + bad + TOOLS_CLOSE, thinking=False)
        assert (got.content, got.tool_calls) == (bad, [])


def test_whitespace_inside_markers_and_escaped_attributes():
    text = ('<|open|> tools <|sep|><|open|>call  tool="a&amp;b&quot;c"  index="1" <|sep|>'
            '<|open|>argument key="k&quot;" type="string"<|sep|>v<|close|> argument<|sep|><|close|>call <|sep|>'
            "<|close|>tools<|sep|>")
    got = check(text, thinking=False)
    assert (got.tool_calls[0].name, json.loads(got.tool_calls[0].arguments)) == ('a&b"c', {'k"': "v"})


def test_k2_output_does_not_crash():
    k2 = ("<think>hmm</think>It is<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
          '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
    assert check(k2, thinking=False).content == k2
    assert check(k2).reasoning == k2


def test_tools_channel_is_text_when_tool_parsing_is_off():
    text = RESPONSE_OPEN + "a" + RESPONSE_CLOSE + tools(call("f")) + TAIL
    assert check(text, tools=False, thinking=False).content == "a" + tools(call("f"))


def test_streaming_emits_content_up_to_a_partial_marker_and_calls_on_close():
    p = K3OutputParser(thinking=False)
    assert p.feed("Hi<|clo") == [ContentDelta("Hi")]
    assert p.feed("se|>response<|sep|>" + TOOLS_OPEN + call("f")[:-3]) == []
    assert p.feed("p|>") == [ToolCall(0, "call_0", "f", "{}")]
    assert p.finish() == []
    assert p.finish() == []
    with pytest.raises(RuntimeError):
        p.feed("x")
    p = K3OutputParser(call_id_prefix="chatcmpl-9-")
    assert p.feed("a" + THINK_CLOSE + "b") == [ReasoningDelta("a"), ContentDelta("b")]
    assert p.feed(TOOLS_OPEN + call("g") + TOOLS_CLOSE)[0].id == "chatcmpl-9-0"


def test_is_reasoning_end_uses_the_last_markers():
    history = THINK_OPEN + "old" + THINK_CLOSE + "answer" + THINK_OPEN
    assert not is_reasoning_end(history)
    assert is_reasoning_end(history + "new" + THINK_CLOSE)
    assert is_reasoning_end("r" + THINK_CLOSE)  # the open was in the prompt
    assert not is_reasoning_end("no markers")
    ids = [5, 1, 2, 3, 9, 4, 2, 3, 7]  # open = [1, 2, 3], close = [4, 2, 3]
    assert is_reasoning_end(ids, [1, 2, 3], [4, 2, 3]) and not is_reasoning_end(ids + [1, 2, 3], [1, 2, 3], [4, 2, 3])


def test_to_message():
    got = check(answer("r", "", call("f", arg("a", "number", "1"))))
    assert got.to_message() == {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
