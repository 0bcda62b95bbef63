"""The compact vocabulary: layout, id map, determinism, and agreement of its three forms."""

import hashlib
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from k3.config import K3Config
from k3.presets import COMPACT_VOCAB_SIZE, compact_special_id
from k3.tokenizer import compact_tokenizer, specials
from k3.tokenizer.compact import (NUM_REGULAR, VOCAB_SIZE, bpe, compact_id, compact_merges,
                                  compact_regular_tokens, kimi_id)

MERGES_SHA256 = "01b65aabb1dff3320d3be915fa7f717e6b1c4262b055d4df5fbbd296d9e0e8d1"
DIGEST = ("import hashlib; from k3.tokenizer.compact import compact_merges; "
          "print(hashlib.sha256(b''.join(a.hex().encode() + b' ' + b.hex().encode() + b'\\n' "
          "for a, b in compact_merges())).hexdigest())")


def merges_digest() -> str:
    lines = b"".join(a.hex().encode() + b" " + b.hex().encode() + b"\n" for a, b in compact_merges())
    return hashlib.sha256(lines).hexdigest()


def test_layout():
    regular = compact_regular_tokens()
    assert len(regular) == NUM_REGULAR == 384 and len(set(regular)) == 384
    assert regular[:256] == [bytes([b]) for b in range(256)]
    assert VOCAB_SIZE == COMPACT_VOCAB_SIZE == 512
    for flavor in ("k3", "k2"):
        tok = compact_tokenizer(flavor)
        assert tok.vocab_size == 512
        assert sorted(tok.special_tokens.values()) == list(range(384, 512))


def test_merges_are_pinned_and_deterministic():
    assert merges_digest() == MERGES_SHA256
    # A fresh interpreter with another hash seed learns the same merges.
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", DIGEST], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == MERGES_SHA256


def test_merges_are_unambiguous():
    """Every merged token has one split into vocabulary tokens (its merge) and BPE rebuilds it:
    what makes the tiktoken and tokenizers forms agree."""
    regular = compact_regular_tokens()
    ranks = {t: i for i, t in enumerate(regular)}
    for (a, b), t in zip(compact_merges(), regular[256:]):
        assert a + b == t and ranks[a] < ranks[t] and ranks[b] < ranks[t]
        splits = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in ranks and t[k:] in ranks]
        assert splits == [(a, b)]
        assert bpe(t, ranks) == [t]


def test_some_merges_split_utf8_characters():
    """The detokenizer tests need characters whose bytes span tokens."""
    partial = [t for t in compact_regular_tokens()[256:] if _not_utf8(t)]
    assert len(partial) >= 5


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


@pytest.mark.parametrize("flavor,name,kimi", [
    ("k3", "[BOS]", 163584), ("k3", "[EOS]", 163585), ("k3", "<|end_of_msg|>", 163586),
    ("k3", "<|open|>", 163587), ("k3", "<|close|>", 163588), ("k3", "<|sep|>", 163589),
    ("k3", "[start_header_id]", 163590), ("k3", "[end_header_id]", 163591), ("k3", "[EOT]", 163593),
    ("k3", "<|kimi_image_placeholder|>", 163605), ("k3", "<osagent_mode>", 163649),
    ("k3", "[UNK]", 163838), ("k3", "[PAD]", 163839), ("k3", "<|reserved_token_163592|>", 163592),
    ("k2", "<|im_end|>", 163586), ("k2", "<|im_user|>", 163587), ("k2", "<|im_assistant|>", 163588),
    ("k2", "<|im_system|>", 163594), ("k2", "<|im_middle|>", 163601),
    ("k2", "<|tool_calls_section_begin|>", 163595), ("k2", "<|tool_call_end|>", 163599),
    ("k2", "<|media_pad|>", 163605), ("k2", "<think>", 163606), ("k2", "</think>", 163607),
    ("k2", "[PAD]", 163839),
])
def test_kimi_id_map(flavor, name, kimi):
    tok = compact_tokenizer(flavor)
    assert tok.token_id(name) == compact_id(kimi) == compact_special_id(kimi)
    assert kimi_id(compact_id(kimi)) == kimi


def test_named_examples():
    k3 = compact_tokenizer("k3")
    assert k3.token_id("<|end_of_msg|>") == 386 and k3.token_id("[PAD]") == 511
    assert k3.token_id("[UNK]") == 510 and k3.bos_id == 384 and k3.eos_ids == (386, 385)


def test_every_slot_matches_presets_map():
    for flavor in ("k3", "k2"):
        for name, i in compact_tokenizer(flavor).special_tokens.items():
            assert compact_special_id(kimi_id(i)) == i
            assert specials.KIMI_SPECIALS[flavor].get(kimi_id(i), specials.reserved_name(kimi_id(i))) == name


@pytest.mark.parametrize("preset,flavor", [("k3-tiny", "k3"), ("k3.1-pro-tiny", "k3"), ("kimi-linear-tiny", "k2")])
def test_tiny_presets_agree_with_the_tokenizer(preset, flavor):
    cfg = K3Config.preset(preset)
    tok = compact_tokenizer(flavor)
    assert cfg.vocab_size == tok.vocab_size
    assert cfg.bos_token_id == tok.bos_id
    assert cfg.pad_token_id == tok.pad_id
    assert cfg.eos_token_ids == tok.eos_ids[:1]
    if cfg.media_placeholder_token_id is not None:
        assert cfg.media_placeholder_token_id == tok.token_id("<|kimi_image_placeholder|>")


_TEXT = st.lists(st.one_of(
    st.characters(codec="utf-8"),
    st.sampled_from(list("  \n\t\r。，你好世界的是 the e a'sTHE123😀🚀")),
    st.sampled_from(["<|open|>", "<|im_end|>", "[BOS]", "[PAD]", "<think>", "<|end_of_msg|>", "'ll", "self",
                     " the", "that", "_size", "我们", "    ", "\n\n"]),
), max_size=40).map("".join)


@settings(max_examples=300, deadline=None)
@given(_TEXT)
def test_written_forms_give_the_builtin_ids(all_tokenizers, text):
    """tiktoken.model + tokenizer_config.json (k3) and tokenizer.json (k2) give exactly the ids
    of the built-in compact tokenizers, with and without special tokens."""
    for allow in (True, False):
        assert all_tokenizers["tiktoken-k3"].encode(text, allow_special=allow) == \
            all_tokenizers["builtin-k3"].encode(text, allow_special=allow)
        assert all_tokenizers["hf-k2"].encode(text, allow_special=allow) == \
            all_tokenizers["builtin-k2"].encode(text, allow_special=allow)
    # The two flavors share their regular tokens.
    assert all_tokenizers["builtin-k3"].encode(text, allow_special=False) == \
        all_tokenizers["builtin-k2"].encode(text, allow_special=False)


def test_written_forms_have_the_builtin_tables(all_tokenizers):
    for written, builtin in (("tiktoken-k3", "builtin-k3"), ("hf-k2", "builtin-k2")):
        a, b = all_tokenizers[written], all_tokenizers[builtin]
        assert dict(a.special_tokens) == dict(b.special_tokens)
        assert a.vocab_size == b.vocab_size and a.flavor == b.flavor
        assert [a.token_bytes(i) for i in range(a.vocab_size)] == [b.token_bytes(i) for i in range(b.vocab_size)]


def test_sample_text_round_trip(all_tokenizers):
    from k3.tokenizer.compact_sample import SAMPLE
    ids = {name: t.encode(SAMPLE) for name, t in all_tokenizers.items()}
    assert len(set(map(tuple, ids.values()))) == 1
    assert len(ids["builtin-k3"]) < 0.7 * len(SAMPLE.encode())   # the merges do compress
