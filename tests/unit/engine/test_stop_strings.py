"""Stop strings over a token stream: spanning tokens, held-back prefixes, nothing past a stop."""

import pytest

from k3.engine.stop import StopStringMatcher


def _stream(pieces, stops):
    m = StopStringMatcher(stops)
    out = "".join(m.push(p) for p in pieces)
    return out + (m.flush() if m.stopped is None else ""), m.stopped


@pytest.mark.parametrize("pieces,stops,expected,stopped", [
    (["Hello", " wor", "ld", "!"], ["world"], "Hello ", "world"),
    (["ab", "c", "d"], ["bcd"], "a", "bcd"),
    (["abc"], ["x"], "abc", None),
    (["a", "b", "a", "b", "c"], ["abc"], "ab", "abc"),        # a held prefix that later fails, then matches
    (["END", "x"], ["END", "ENDx"], "", "END"),
    (["xy", "z"], ["yzq"], "xyz", None),                    # a held prefix released at the end
    (["one two", " three"], ["two", "one"], "", "one"),       # the earliest stop wins
])
def test_stop_strings(pieces, stops, expected, stopped):
    assert _stream(pieces, stops) == (expected, stopped)


def test_nothing_after_stop():
    m = StopStringMatcher(["stop"])
    assert m.push("go stop now") == "go "
    assert m.push("more") == "" and m.flush() == ""


def test_held_text_is_not_emitted_early():
    m = StopStringMatcher(["</end>"])
    assert m.push("text </e") == "text "
    assert m.push("x") == "</ex"
