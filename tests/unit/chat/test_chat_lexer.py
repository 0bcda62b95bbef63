"""The incremental XTML lexer: which strings are markers, and split-invariance."""

from hypothesis import given, settings
from hypothesis import strategies as st

from k3.chat.lexer import MAX_HEAD, Marker, XtmlLexer, lex


def kinds(text):
    return [t if isinstance(t, str) else (t.kind, t.name, t.attrs) for t in lex(text)]


def test_markers_and_text():
    text = 'a<|open|>call tool="f&amp;g" index="1"<|sep|>b<|close|>call<|sep|><|end_of_msg|>'
    assert kinds(text) == ["a", ("open", "call", {"tool": "f&g", "index": "1"}), "b",
                           ("close", "call", {}), ("eom", "", {})]
    assert "".join(t if isinstance(t, str) else t.raw for t in lex(text)) == text


def test_whitespace_inside_markers_is_tolerated():
    assert kinds('<|open|> tools <|sep|><|close|>\ncall\t<|sep|><|open|>x  k="v"  <|sep|>') == [
        ("open", "tools", {}), ("close", "call", {}), ("open", "x", {"k": "v"})]


def test_non_markers_are_text():
    for text in ["<|sep|>", "<|im_end|>", "<|open|><|sep|>", "<|close|>call x<|sep|>",
                 '<|open|>call tool=f<|sep|>', '<|open|>callx="1"<|sep|>', '<|open|>a b="<|sep|>"<|sep|>',
                 "a < b <| c", "<|open|>call", "<|clo"]:
        assert lex(text) == [text], text


def test_partial_marker_is_held_back_until_decided():
    lx = XtmlLexer()
    assert lx.feed("Hi<|clo") == ["Hi"]
    assert lx.feed("se|>resp") == []
    assert lx.feed("onse<|sep|>!") == [Marker("close", "response", "<|close|>response<|sep|>"), "!"]
    assert lx.feed('<|open|>call tool="x') == []
    assert lx.finish() == ['<|open|>call tool="x']


def test_overlong_head_is_text():
    text = '<|open|>call tool="' + "x" * MAX_HEAD + '"<|sep|>'
    assert lex(text) == [text]
    lx = XtmlLexer()
    assert lx.feed(text[: MAX_HEAD + 20]) == [text[: MAX_HEAD + 20]]  # decided without the rest


PIECES = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "call", " tool=", '"f"', "think", " ",
          "<", "|", "x", "\n", "<|im_end|>", 'k="a&quot;b"', "response", "tools"]


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.sampled_from(PIECES), max_size=30), st.lists(st.integers(0, 200), max_size=8))
def test_any_split_gives_the_same_tokens(pieces, cuts):
    text = "".join(pieces)
    whole = lex(text)
    lx, got, last = XtmlLexer(), [], 0
    for cut in sorted(c % (len(text) + 1) for c in cuts) + [len(text)]:
        got += lx.feed(text[last:cut])
        last = cut
    got += lx.finish()
    merged = []
    for t in got:  # text may come in more pieces; markers must be identical
        if merged and isinstance(t, str) and isinstance(merged[-1], str):
            merged[-1] += t
        else:
            merged.append(t)
    assert merged == whole
    assert "".join(t if isinstance(t, str) else t.raw for t in got) == text
