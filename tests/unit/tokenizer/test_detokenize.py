"""IncrementalDetokenizer: streams equal full decodes and hold back split UTF-8 characters."""

import pytest
from hypothesis import given, settings, strategies as st

from k3.tokenizer import IncrementalDetokenizer, compact_tokenizer

TOK = compact_tokenizer("k3")
EMOJI = "😀"   # its 4 bytes are split across tokens by the compact merges


def stream(tok, ids, cuts, **kw):
    det = IncrementalDetokenizer(tok, **kw)
    bounds = [0, *sorted(cuts), len(ids)]
    parts = [det.step(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    return parts, det.finish()


def test_split_character_is_held_back():
    ids = TOK.encode(" " + EMOJI)
    assert len(ids) > 1 and all(TOK.token_bytes(i).decode("utf-8", "replace") != EMOJI for i in ids)
    det = IncrementalDetokenizer(TOK)
    outs = []
    for i in ids[:-1]:
        outs.append(det.step([i]))
        assert det.pending_bytes > 0
    outs.append(det.step(ids[-1:]))
    assert EMOJI not in "".join(outs[:-1]) and EMOJI in outs[-1] and "\ufffd" not in "".join(outs)
    assert "".join(outs) == " " + EMOJI and det.pending_bytes == 0
    assert det.finish() == ""


def test_specials_stream_as_names_without_spaces():
    ids = TOK.encode("<|open|>think<|sep|>好<|close|>think<|sep|><|end_of_msg|>")
    parts, tail = stream(TOK, ids, range(1, len(ids)))
    assert "".join(parts) + tail == "<|open|>think<|sep|>好<|close|>think<|sep|><|end_of_msg|>"
    parts, tail = stream(TOK, ids, range(1, len(ids)), skip_special_tokens=True)
    assert "".join(parts) + tail == "think好think"


def test_truncated_character_is_flushed_by_finish():
    ids = TOK.encode(EMOJI)[:-1]
    det = IncrementalDetokenizer(TOK)
    assert det.step(ids) == "" and det.pending_bytes > 0
    assert det.finish() == "\ufffd" == TOK.decode(ids)
    with pytest.raises(RuntimeError):
        det.step([1])


def test_invalid_bytes_are_replaced_at_once():
    # 0xff can never be UTF-8: it is replaced immediately, the rest streams normally.
    det = IncrementalDetokenizer(TOK)
    assert det.step([0xFF, ord("a")]) == "\ufffda"


_TEXT = st.lists(st.one_of(st.characters(codec="utf-8"),
                           st.sampled_from(["😀", "🚀", "你好", "的", "。", "❤️", "<|sep|>", "[EOS]", " the"])),
                 max_size=30).map("".join)


@settings(max_examples=200, deadline=None)
@given(_TEXT, st.data())
def test_stream_equals_decode_and_has_no_stray_replacement(text, data):
    ids = TOK.encode(text)
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=len(ids) + 1))
    skip = data.draw(st.booleans())
    parts, tail = stream(TOK, ids, cuts, skip_special_tokens=skip)
    assert "".join(parts) + tail == TOK.decode(ids, skip_special_tokens=skip)
    assert "\ufffd" not in "".join(parts) + tail or "\ufffd" in text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 383), max_size=40), st.data())
def test_random_ids_stream_equals_decode(ids, data):
    """Arbitrary byte soup (invalid UTF-8 included) streams to exactly decode()'s text."""
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=len(ids) + 1))
    parts, tail = stream(TOK, ids, cuts)
    assert "".join(parts) + tail == TOK.decode(ids)


def test_long_stream_one_token_at_a_time():
    """The detokenizer keeps no decoded history: at most one incomplete character's bytes."""
    det = IncrementalDetokenizer(TOK)
    ids = TOK.encode("你好世界，😀 hello " * 2000)
    out = []
    for i in ids:
        out.append(det.step([i]))
        assert det.pending_bytes <= 3
    assert "".join(out) + det.finish() == TOK.decode(ids)
