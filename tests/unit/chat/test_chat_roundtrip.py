"""render -> parse round trips: an assistant turn rendered as history parses back to itself."""

import json

from chat_cases import output_of, random_calls, random_text
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.chat import K3OutputParser, render_k3_chat

TURN = {
    "role": "assistant",
    "reasoning_content": "The user wants weather and a file.\n<b> & \"quotes\"",
    "content": "Let me check both.",
    "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
            {"city": "São Paulo\n\"centre\"", "days": 3, "metric": True, "hint": None,
             "opts": {"units": ["C", "F"]}, "ratio": 0.25})}},
        {"id": "b", "type": "function", "function": {"name": "read&file", "arguments": '{"path": "/tmp/a\\"b"}'}},
    ],
}


def normal(message: dict, thinking: bool) -> dict:
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"] or "{}")) for c in message.get("tool_calls", [])]
    reasoning = (message.get("reasoning_content") or "") if thinking else ""
    return {"reasoning": reasoning, "content": message.get("content") or "", "calls": calls}


def round_trip(message: dict, thinking: bool) -> dict:
    parsed = K3OutputParser(thinking=thinking).parse(output_of(message, thinking))
    again = parsed.to_message()
    assert render_k3_chat([again], thinking=thinking) == render_k3_chat([message], thinking=thinking)
    return normal(again, thinking)


def test_assistant_turn_with_reasoning_and_tool_calls_round_trips():
    assert round_trip(TURN, thinking=True) == normal(TURN, True)
    assert round_trip(TURN, thinking=False) == normal(TURN, False)


@settings(max_examples=150, deadline=None, database=None)
@given(random_text, random_text, random_calls, st.booleans())
def test_random_turns_round_trip(reasoning, content, tool_calls, thinking):
    message = {"role": "assistant", "reasoning_content": reasoning, "content": content, "tool_calls": [
        {"id": str(i), "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(tool_calls)]}
    assert round_trip(message, thinking) == normal(message, thinking)
