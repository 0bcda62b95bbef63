"""Round trips and special-token handling, for every source of the compact vocabulary."""

import pytest
from hypothesis import given, settings, strategies as st

from k3.tokenizer import specials

TEXTS = [
    "",
    "Hello, world! It's 2026; the model's answer is 42.",
    "def f(x):\n    return x * 2\n\n\n\tindented\r\n  trailing   ",
    "我们的模型可以理解中文，也可以写代码。",
    "emoji 😀🚀✨👍🏽 and flags 🇨🇳 and zwj 👩‍💻",
    "mixed: hello世界 ÉCOLE naïve café Ωmega 1234567 ١٢٣ \u00a0nbsp",
]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert not any(tok.is_special(i) for i in ids)
    assert tok.decode(ids) == text


def test_mixed_text_with_special_tokens(tok):
    eom = specials.END_OF_MESSAGE[tok.flavor]
    text = f"[BOS]first 你好 😀{eom}second[EOS]{eom}{eom}[PAD]"
    ids = tok.encode(text)
    assert tok.decode(ids) == text                     # no spaces inserted between specials
    assert ids[0] == tok.bos_id
    assert ids[-4:] == [tok.eos_ids[1], tok.eos_ids[0], tok.eos_ids[0], tok.pad_id]
    assert tok.decode(ids, skip_special_tokens=True) == "first 你好 😀second"


def test_special_tokens_encode_to_their_table_ids(tok):
    for name, i in tok.special_tokens.items():
        assert tok.encode(name) == [i]
        assert tok.token_id(name) == i
        assert tok.id_to_token(i) == name
        assert tok.decode([i]) == name


def test_allow_special_false_encodes_names_literally(tok):
    eom = specials.END_OF_MESSAGE[tok.flavor]
    text = f"a{eom}b[BOS]"
    ids = tok.encode(text, allow_special=False)
    assert not any(tok.is_special(i) for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text) != ids


def test_flavor_and_named_ids(tok):
    assert tok.flavor in ("k3", "k2")
    eom = {"k3": "<|end_of_msg|>", "k2": "<|im_end|>"}[tok.flavor]
    assert tok.eos_ids == (tok.token_id(eom), tok.token_id("[EOS]"))
    assert tok.bos_id == tok.token_id("[BOS]") and tok.pad_id == tok.token_id("[PAD]")
    if tok.flavor == "k3":
        assert "<|open|>" in tok.special_tokens and "<|im_end|>" not in tok.special_tokens
    else:
        assert "<think>" in tok.special_tokens and "<|open|>" not in tok.special_tokens


def test_regular_token_names_round_trip(tok):
    for i in range(0, 384, 7):
        name = tok.id_to_token(i)
        assert tok.token_id(name) == i
    assert tok.id_to_token(ord(" ")) == "Ġ"
    with pytest.raises(KeyError):
        tok.token_id("<|no_such_token|>")


def test_bad_ids_are_rejected(tok):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([1, tok.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([-1])


def test_lone_surrogate_does_not_crash(tok):
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffdb"


def test_long_runs_are_split_safely(tok):
    text = "x" + " " * 600_000 + "y" + "z" * 60_000
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=60))
def test_round_trip_any_text(all_tokenizers, text):
    for t in all_tokenizers.values():
        assert t.decode(t.encode(text, allow_special=False)) == text
