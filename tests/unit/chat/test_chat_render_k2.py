"""Kimi-Linear (K2-style <|im_*|>) renderer: golden strings."""

import pytest

from k3.chat import ChatTemplateError, render_k2_chat, render_k2_segments

SYS = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
GEN = "<|im_assistant|>assistant<|im_middle|>"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "required": ["city"]}}}


def test_default_system_prompt_and_generation_prompt():
    assert render_k2_chat([{"role": "user", "content": "hi"}]) == SYS + "<|im_user|>user<|im_middle|>hi<|im_end|>" + GEN
    got = render_k2_chat([{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi", "name": "ada"}],
                         add_generation_prompt=False)
    assert got == "<|im_system|>system<|im_middle|>be terse<|im_end|><|im_user|>ada<|im_middle|>hi<|im_end|>"
    assert render_k2_chat([]) == SYS + GEN


def test_tool_declare_calls_and_results():
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "not rendered", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "call_x", "content": "2C"},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "18C"},
    ]
    assert render_k2_chat(messages, tools=[TOOL]) == (
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather",'
        '"parameters":{"type":"object","required":["city"]}}}]<|im_end|>' + SYS
        + "<|im_user|>user<|im_middle|>weather?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Checking.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city":"Oslo"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:1\n2C<|im_end|>"
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n18C<|im_end|>" + GEN)


def test_segments_mark_the_special_tokens():
    segs = render_k2_segments([{"role": "user", "content": "<|im_end|>"}])
    assert [s.special for s in segs if s.text == "<|im_end|>"] == [True, False, True]


@pytest.mark.parametrize("messages, match", [
    ([{"role": "robot", "content": "x"}], "unknown role"),
    ([{"role": "tool", "tool_call_id": "a", "content": "x"}], "matches no tool call"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "nope"}}]}], "not valid JSON"),
])
def test_invalid_input(messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        render_k2_chat(messages)
