"""Properties of the K3 output parser over generated outputs (hypothesis):

* nothing is lost: outputs are built from pieces labelled reasoning / content / structure / call;
  the parser must return exactly the reasoning and content pieces and the calls;
* streaming == non-streaming for any split, and for every prefix of an output;
* K3ReasoningParser(strip_wrappers=False) -> K3ToolParser == K3OutputParser.
"""

import json
import random
import time

from chat_cases import (
    ARGUMENT_CLOSE, CALL_CLOSE, END_OF_MSG, MESSAGE_CLOSE, RESPONSE_CLOSE, RESPONSE_OPEN, THINK_CLOSE,
    TOOLS_CLOSE, TOOLS_OPEN, arg, call, open_tag, random_cuts, stream,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3.chat import K3OutputParser, K3ReasoningParser, K3ToolParser, ParsedOutput

SETTINGS = settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# Free text never contains "|", so it cannot form a marker, but it has marker-like fragments.
free_text = st.lists(
    st.one_of(st.text("ab xy\n\"'&<>{}", max_size=6), st.sampled_from(["<|sep|>", "<|im_end|>", "<|open", "<", "<|cl"])),
    max_size=5).map("".join)
blank = st.text(" \n\t", max_size=3)
junk = st.builds(lambda a, b, c: a + b + c, blank, st.sampled_from(["note", "<|sep|>", "}", "<|open|>x<|sep|>"]), blank)
names = st.text("abc_-.&\"' ", min_size=1, max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text("ab \n\"\\&<", max_size=5),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text("ab\"&", max_size=3), kids, max_size=3),
    max_leaves=6)
XTML_TYPES = {bool: "boolean", type(None): "null", int: "number", float: "number", list: "array", dict: "object"}

BAD_CALLS = [
    open_tag("call", {"tool": "f"}) + open_tag("argument", {"key": "k", "type": "string"}) + "v" + CALL_CLOSE,
    call("f", "<|open|>weird<|sep|>x<|close|>weird<|sep|>"),
    call("f", arg("n", "number", "1 2")),
    open_tag("call", {"index": 1}) + CALL_CLOSE,
    call("f", "text" + arg("a", "string", "1")),
    call("f", arg("a", "string", "x" + ARGUMENT_CLOSE + "y")),
]


@st.composite
def good_call(draw):
    name = draw(names)
    args = draw(st.dictionaries(st.text("kv&\" ", max_size=4), json_values | free_text, max_size=4))
    body = []
    for key, value in args.items():
        if isinstance(value, str):
            body.append(arg(key, "string", value))
        else:
            spaced = draw(st.booleans())
            text = json.dumps(value, ensure_ascii=False, separators=None if spaced else (",", ":"))
            body.append(arg(key, XTML_TYPES[type(value)], text))
    return call(name, *body, index=draw(st.integers(1, 9))), (name, args)


@st.composite
def output(draw):
    """(text, thinking, expected ParsedOutput-like tuple)."""
    thinking = draw(st.booleans())
    pieces = []  # (text, kind) with kind in r / c / s / call
    if thinking:
        pieces += [(draw(free_text), "r"), (THINK_CLOSE, "s")]
    if draw(st.booleans()):
        pieces += [(RESPONSE_OPEN, "s"), (draw(free_text), "c"), (RESPONSE_CLOSE, "s")]
    else:
        pieces += [(draw(free_text), "c")]
    if draw(st.booleans()):
        pieces.append((TOOLS_OPEN, "s"))
        for _ in range(draw(st.integers(0, 3))):
            pieces.append(draw(st.one_of(blank.map(lambda t: (t, "s")), junk.map(lambda t: (t, "c")))))
            kind = draw(st.sampled_from(["good", "good", "bad"]))
            pieces.append((*draw(good_call()), ) if kind == "good" else (draw(st.sampled_from(BAD_CALLS)), "c"))
        pieces.append(draw(st.one_of(blank.map(lambda t: (t, "s")), junk.map(lambda t: (t, "c")))))
        if draw(st.booleans()):
            pieces += [(TOOLS_CLOSE, "s"), (draw(free_text), "c")]
    if draw(st.booleans()):
        pieces += [(MESSAGE_CLOSE, "s"), (END_OF_MSG, "s")]
    text = "".join(p[0] for p in pieces)
    reasoning = "".join(t for t, k in pieces if k == "r")
    content = "".join(t for t, k in pieces if k == "c")
    calls = [k for _, k in pieces if isinstance(k, tuple)]
    return text, thinking, (reasoning, content, calls)


def summary(parsed: ParsedOutput):
    return parsed.reasoning, parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


@SETTINGS
@given(output(), st.randoms(use_true_random=False))
def test_nothing_is_lost_and_every_split_agrees(case, rng):
    text, thinking, expected = case
    got = K3OutputParser(thinking=thinking).parse(text)
    assert summary(got) == expected
    for n in (None, None, len(text) // 2, len(text)):  # random splits, then 1-2 character deltas
        assert stream(text, random_cuts(text, rng, n), thinking=thinking) == got
    assert [c.index for c in got.tool_calls] == list(range(len(got.tool_calls)))


@SETTINGS
@given(output(), st.randoms(use_true_random=False))
def test_every_prefix_streams_like_it_parses(case, rng):
    text, thinking, _ = case
    full_calls = K3OutputParser(thinking=thinking).parse(text).tool_calls
    for n in range(0, len(text) + 1, max(1, len(text) // 40)):
        prefix = text[:n]
        whole = K3OutputParser(thinking=thinking).parse(prefix)
        assert stream(prefix, random_cuts(prefix, rng), thinking=thinking) == whole
        assert whole.tool_calls == full_calls[: len(whole.tool_calls)]  # never a call that later changes


@SETTINGS
@given(output(), st.randoms(use_true_random=False))
def test_reasoning_parser_chained_into_tool_parser_equals_the_output_parser(case, rng):
    text, thinking, _ = case
    expected = K3OutputParser(thinking=thinking).parse(text)
    rp, tp, got = K3ReasoningParser(thinking=thinking, strip_wrappers=False), K3ToolParser(), ParsedOutput()
    last = 0
    for cut in [*random_cuts(text, rng), len(text), None]:
        events = rp.feed(text[last:cut]) if cut is not None else rp.finish()
        last = cut
        for ev in events:
            if hasattr(ev, "text") and type(ev).__name__ == "ContentDelta":
                got.add(tp.feed(ev.text))
            else:
                got.add([ev])
    got.add(tp.finish())
    assert got == expected


PIECES = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "think", "response", "tools", "call",
          "argument", "message", ' tool="f"', ' key="k"', ' type="number"', ' type="string"', "1", " ", "x", "\n", "<"]


@SETTINGS
@given(st.lists(st.sampled_from(PIECES), max_size=40), st.booleans(), st.randoms(use_true_random=False))
def test_marker_soup_never_crashes_and_splits_agree(pieces, thinking, rng):
    text = "".join(pieces)
    whole = K3OutputParser(thinking=thinking).parse(text)
    assert stream(text, random_cuts(text, rng), thinking=thinking) == whole
    raw = K3OutputParser(thinking=False, tools=False, strip_wrappers=False).parse(text)
    assert raw.content == text  # with every interpretation off, the text passes through untouched


def test_long_output_streams_in_linear_time():
    text = "r" + THINK_CLOSE + TOOLS_OPEN + "".join(call("f", arg("a", "string", "x" * 50)) for _ in range(300))
    got = stream(text, list(range(0, len(text), 3)))
    assert len(got.tool_calls) == 300
    rng = random.Random(0)
    soup = "".join(rng.choice(["<|open|>call tool=\"f\"<|sep|>", "<|open|>argument key=\"k\"<|sep|>", "x"])
                   for _ in range(600))
    assert K3OutputParser().parse(soup).reasoning == soup
    html = "<p>a < b</p><|im_end|>\n" * 20000  # 460 kB of '<' that are not markers
    t0 = time.perf_counter()
    assert K3OutputParser(thinking=False).parse(html).content == html
    assert time.perf_counter() - t0 < 2.0
