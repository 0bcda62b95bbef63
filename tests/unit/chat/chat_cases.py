"""Builders for K3 XTML output and helpers that drive the parsers in streaming mode."""

from __future__ import annotations

import random

from hypothesis import strategies as st

from k3.chat import K3OutputParser, ParsedOutput, render_k3_chat
from k3.chat.xtml import (
    ARGUMENT_CLOSE, CALL_CLOSE, END_OF_MSG, GENERATION_PREFIX_INSTRUCT, GENERATION_PREFIX_THINKING, MESSAGE_CLOSE,
    RESPONSE_CLOSE, RESPONSE_OPEN, THINK_CLOSE, THINK_OPEN, TOOLS_CLOSE, TOOLS_OPEN, open_tag,
)

TAIL = MESSAGE_CLOSE + END_OF_MSG


def arg(key: str, typ: str, body: str) -> str:
    return open_tag("argument", {"key": key, "type": typ}) + body + ARGUMENT_CLOSE


def call(name: str, *args: str, index: int = 1) -> str:
    return open_tag("call", {"tool": name, "index": index}) + "".join(args) + CALL_CLOSE


def tools(*calls: str) -> str:
    return TOOLS_OPEN + "".join(calls) + TOOLS_CLOSE


def answer(reasoning: str | None, content: str, *calls: str) -> str:
    """A thinking-mode output (the think-open is in the prompt) or, with reasoning=None, instruct."""
    head = "" if reasoning is None else reasoning + THINK_CLOSE + RESPONSE_OPEN
    return head + content + RESPONSE_CLOSE + (tools(*calls) if calls else "") + TAIL


def stream(text: str, cuts: list[int], **options) -> ParsedOutput:
    """Feed ``text`` cut at ``cuts`` (sorted positions) to a fresh parser; collect the events."""
    parser = K3OutputParser(**options)
    out = ParsedOutput()
    last = 0
    for cut in [*cuts, len(text)]:
        out.add(parser.feed(text[last:cut]))
        last = cut
    return out.add(parser.finish())


def random_cuts(text: str, rng: random.Random, n: int | None = None) -> list[int]:
    n = rng.randint(0, min(len(text), 12)) if n is None else n
    return sorted(rng.sample(range(len(text) + 1), min(n, len(text) + 1)))


def check(text: str, **options) -> ParsedOutput:
    """parse(text), after asserting that char-by-char and random-split streaming agree with it."""
    whole = K3OutputParser(**options).parse(text)
    assert stream(text, list(range(len(text))), **options) == whole
    rng = random.Random(len(text))
    for _ in range(20):
        assert stream(text, random_cuts(text, rng), **options) == whole
    return whole


def output_of(message: dict, thinking: bool) -> str:
    """The model output that would have produced an assistant ``message``: its rendering as
    history minus the generation prefix."""
    rendered = render_k3_chat([message], thinking=thinking, add_generation_prompt=False)
    prefix = GENERATION_PREFIX_THINKING if thinking else GENERATION_PREFIX_INSTRUCT
    return rendered[rendered.index(prefix) + len(prefix):]


# Random assistant turns: any text without "|" (so it cannot form a marker), any JSON arguments.
random_text = st.text(st.characters(blacklist_characters="|", blacklist_categories=("Cs",)), max_size=12)
_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | random_text,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(random_text, kids, max_size=3), max_leaves=8)
random_calls = st.lists(st.tuples(random_text.filter(bool), st.dictionaries(random_text, _values, max_size=4)), max_size=3)

__all__ = [
    "ARGUMENT_CLOSE", "CALL_CLOSE", "END_OF_MSG", "MESSAGE_CLOSE", "RESPONSE_CLOSE", "RESPONSE_OPEN",
    "TAIL", "THINK_CLOSE", "THINK_OPEN", "TOOLS_CLOSE", "TOOLS_OPEN", "answer", "arg", "call", "check",
    "open_tag", "output_of", "random_calls", "random_cuts", "random_text", "stream", "tools",
]
