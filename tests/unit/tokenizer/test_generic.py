"""Tokenizers that are not Kimi's: no K3 / K2 chat markers, no BOS / PAD, not byte-level BPE.

Every vocabulary is built here with the `tokenizers` library (or written as a tiktoken file);
k3 must load it, give the library's own ids, round-trip text and stream it."""

import base64
import json
import random

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer as HFCore, decoders, models, normalizers, pre_tokenizers, processors, trainers

from k3.tokenizer import IncrementalDetokenizer, load_tokenizer
from k3.tokenizer.hf_vocab import HFTokenizer
from k3.tokenizer.hf_wrapped import WrappedHFTokenizer
from k3.tokenizer.tiktoken_vocab import TiktokenTokenizer

CORPUS = ["hello world, the model thinks", "the quick brown fox jumps over the lazy dog",
          "你好世界 the answer is 42", "streaming text, one token at a time"] * 20
TEXTS = ["hello world", "the lazy fox jumps, the model thinks", "你好 the answer is 42",
         "emoji 😀 and é and ü"]


def _gpt2_like(d):
    """A GPT-2-style byte-level BPE with only <|endoftext|> as an added token."""
    core = HFCore(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    core.train_from_iterator(CORPUS, trainer)
    core.save(str(d / "tokenizer.json"))
    return core


def _unigram(d):
    """A sentencepiece-style Unigram: Metaspace pre-tokeniser, "▁" -> " " decoder, <0xNN> byte
    fallback, <s> / </s> added after the pieces, a BOS-adding post-processor."""
    trained = HFCore(models.Unigram())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=150, special_tokens=["<unk>"],
                                                                unk_token="<unk>", show_progress=False))
    pieces = [tuple(p) for p in json.loads(trained.to_str())["model"]["vocab"]]
    vocab = pieces[:1] + [(f"<0x{b:02X}>", -100.0) for b in range(256)] + pieces[1:]
    core = HFCore(models.Unigram(vocab, 0, True))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])     # Llama 2's sentencepiece decoder
    core.add_special_tokens(["<s>", "</s>"])
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", core.token_to_id("<s>"))])
    core.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    return core


def _wordpiece(d):
    """A BERT-style WordPiece: lowercasing normaliser, [CLS] ... [SEP] post-processor."""
    core = HFCore(models.WordPiece(unk_token="[UNK]"))
    core.normalizer = normalizers.BertNormalizer(lowercase=True)
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.decoder = decoders.WordPiece()
    core.train_from_iterator(CORPUS, trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"], show_progress=False))
    core.post_processor = processors.BertProcessing(("[SEP]", core.token_to_id("[SEP]")),
                                                    ("[CLS]", core.token_to_id("[CLS]")))
    core.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"pad_token": "[PAD]", "eos_token": "[SEP]"}))
    return core


def _stream(tok, ids, cuts, **kw):
    det = IncrementalDetokenizer(tok, **kw)
    bounds = [0, *sorted(set(cuts)), len(ids)]
    return "".join(det.step(ids[a:b]) for a, b in zip(bounds, bounds[1:])) + det.finish()


def test_gpt2_like_byte_level_without_markers(tmp_path):
    core = _gpt2_like(tmp_path)
    eot = core.token_to_id("<|endoftext|>")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "eos_token_id": eot}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and tok.byte_level
    assert tok.flavor is None and tok.bos_id is None and tok.pad_id is None
    assert tok.eos_ids == (eot,)                                 # from config.json
    missing = tok.missing_chat_markers()
    assert set(missing) == {"k3", "k2"} and "<|end_of_msg|>" in missing["k3"] and "<|im_end|>" in missing["k2"]
    for text in TEXTS:
        assert tok.encode(text) == core.encode(text).ids
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("a<|endoftext|>b") == core.encode("a<|endoftext|>b").ids
    assert eot not in tok.encode("a<|endoftext|>b", allow_special=False)
    assert repr(tok).startswith("<HFTokenizer no chat format")


def test_generation_config_eos_wins_over_config_json(tmp_path):
    core = _gpt2_like(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [core.token_to_id("<|endoftext|>"), 7]}))
    assert load_tokenizer(tmp_path).eos_ids == (core.token_to_id("<|endoftext|>"), 7)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").unlink()
    assert load_tokenizer(tmp_path).eos_ids == ()                # no EOS anywhere: still loads


def test_unigram_metaspace_is_wrapped(tmp_path):
    core = _unigram(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, WrappedHFTokenizer) and not tok.byte_level and tok.flavor is None
    assert tok.bos_id == core.token_to_id("<s>") and tok.eos_ids == (core.token_to_id("</s>"),)
    assert tok.pad_id is None and tok.vocab_size == core.get_vocab_size()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == core.encode(text, add_special_tokens=False).ids       # no <s> added
        assert tok.decode(ids) == text
    mixed = "hello</s>world<s> x"
    assert tok.encode(mixed) == core.encode(mixed, add_special_tokens=False).ids
    assert tok.decode(tok.encode(mixed)) == mixed
    assert core.token_to_id("</s>") not in tok.encode(mixed, allow_special=False)
    assert tok.decode(tok.encode(mixed), skip_special_tokens=True) == core.decode(
        core.encode("helloworld x", add_special_tokens=False).ids)
    assert tok.token_bytes(tok.token_id("<0xF0>")) == b"\xf0" and tok.token_bytes(tok.bos_id) == b"<s>"
    piece = tok.id_to_token(tok.encode("the")[0])
    assert piece.startswith("▁") and tok.token_id(piece) == tok.encode("the")[0]


def test_wordpiece_is_wrapped(tmp_path):
    core = _wordpiece(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, WrappedHFTokenizer) and tok.flavor is None and tok.bos_id is None
    assert tok.pad_id == core.token_to_id("[PAD]") and tok.eos_ids == (core.token_to_id("[SEP]"),)
    text = "the lazy fox jumps, the model thinks"
    ids = tok.encode(text)
    assert ids == core.encode(text, add_special_tokens=False).ids and core.token_to_id("[CLS]") not in ids
    assert tok.decode(ids) == text == core.decode(ids)
    assert tok.decode(tok.encode("The Quick Brown Fox")) == "the quick brown fox"   # the normaliser lowercases


def test_byte_level_bpe_missing_bytes_is_wrapped(tmp_path):
    core = HFCore(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, show_progress=False))   # seen bytes only
    core.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, WrappedHFTokenizer)
    assert tok.decode(tok.encode("the lazy dog")) == "the lazy dog" == core.decode(core.encode("the lazy dog").ids)


@pytest.mark.parametrize("build", [_unigram, _wordpiece, _gpt2_like], ids=["unigram", "wordpiece", "gpt2"])
def test_stream_equals_decode(tmp_path, build):
    build(tmp_path)
    tok = load_tokenizer(tmp_path)
    rng = random.Random(0)
    for text in TEXTS + [" ".join(TEXTS)]:
        if build is _wordpiece:
            text = text.split(" emoji")[0].replace("你好 ", "")
        ids = tok.encode(text)
        full = tok.decode(ids)
        assert _stream(tok, ids, range(1, len(ids))) == full                 # one id at a time
        assert _stream(tok, ids, rng.sample(range(1, len(ids)), len(ids) // 3)) == full
        specials = list(tok.special_tokens.values())
        with_specials = ids[:3] + specials + ids[3:]
        for skip in (False, True):
            assert _stream(tok, with_specials, range(1, len(with_specials)), skip_special_tokens=skip) == \
                tok.decode(with_specials, skip_special_tokens=skip)


def test_wrapped_stream_holds_a_split_character(tmp_path):
    _unigram(tmp_path)
    tok = load_tokenizer(tmp_path)
    ids = tok.encode("a 😀")
    emoji = [tok.token_id(f"<0x{b:02X}>") for b in "😀".encode()]
    assert ids[-4:] == emoji
    det = IncrementalDetokenizer(tok)
    out = det.step(ids[:-4]) + "".join(det.step([i]) for i in emoji[:3])
    assert "\ufffd" not in out and det.pending_bytes == 3
    assert out + det.step(emoji[3:]) == "a 😀" and det.pending_bytes == 0 and det.finish() == ""
    long = tok.encode("x " + "😀" * 5 + " y")                             # a run of 20 byte tokens
    assert _stream(tok, long, range(1, len(long))) == "x " + "😀" * 5 + " y"
    det = IncrementalDetokenizer(tok)
    flushed = det.step(ids[:-1]) + det.finish()                          # an incomplete character
    assert flushed == tok.decode(ids[:-1]) and flushed.startswith("a \ufffd")


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40), st.data())
def test_wrapped_random_text_streams_as_decoded(unigram_tok, text, data):
    """Byte-fallback runs (every character outside the pieces) must never be cut by the window."""
    ids = unigram_tok.encode(text)
    cuts = data.draw(st.lists(st.integers(1, max(1, len(ids) - 1)), max_size=len(ids)))
    assert _stream(unigram_tok, ids, cuts) == unigram_tok.decode(ids)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 400), min_size=1, max_size=30), st.data())
def test_wrapped_random_ids_stream_equals_decode(unigram_tok, ids, data):
    """Any ids but byte-fallback ones (an invalid byte run is rewritten by HF's decoder)."""
    ids = [i for i in (i % unigram_tok.vocab_size for i in ids) if i not in unigram_tok.byte_fallback_ids]
    cuts = data.draw(st.lists(st.integers(1, max(1, len(ids) - 1)), max_size=len(ids)))
    assert _stream(unigram_tok, ids, cuts) == unigram_tok.decode(ids)


@pytest.fixture(scope="module")
def unigram_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("unigram")
    _unigram(d)
    return load_tokenizer(d)


def test_tiktoken_model_without_markers(tmp_path):
    regular = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hello", b" w", b"or", b"ld"]
    (tmp_path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(regular)))
    n = len(regular)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(n): {"content": "<|endoftext|>", "special": True}}}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": n}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TiktokenTokenizer) and tok.flavor is None
    assert tok.eos_ids == (n,) and tok.bos_id is None and tok.pad_id is None
    assert tok.encode("hello world<|endoftext|>") == [n - 4, n - 3, n - 2, n - 1, n]
    assert tok.decode(tok.encode("hello 世界 😀")) == "hello 世界 😀"
    (tmp_path / "tokenizer_config.json").write_text("{}")                  # no special tokens at all
    (tmp_path / "generation_config.json").unlink()
    tok = load_tokenizer(tmp_path)
    assert tok.special_tokens == {} and tok.vocab_size == n and tok.eos_ids == ()
    assert tok.decode(tok.encode("hello<|endoftext|>")) == "hello<|endoftext|>"


def test_a_role_naming_no_token_is_refused(tmp_path):
    _gpt2_like(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(ValueError, match="names '<s>' as its bos_token"):
        load_tokenizer(tmp_path)


def test_chat_markers_are_what_the_renderers_emit():
    from k3.chat import render_k2, xtml
    from k3.tokenizer import specials

    assert specials.CHAT_MARKERS["k3"] == xtml.SPECIAL_TOKENS
    assert set(specials.CHAT_MARKERS["k2"]) == {render_k2.IM_SYSTEM, render_k2.IM_USER, render_k2.IM_ASSISTANT,
                                               render_k2.IM_MIDDLE, render_k2.IM_END}


def test_chat_format_names_the_absent_markers(tmp_path):
    from k3.chat import ChatFormatUnavailable
    from k3.chat.template import chat_format, chat_prompt_ids

    regular = [bytes([b]) for b in range(256)]
    (tmp_path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(regular)))
    names = ["<|end_of_msg|>", "<|open|>"]                     # a K3 vocabulary lacking <|close|>, <|sep|>
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(256 + i): {"content": n} for i, n in enumerate(names)}}))
    tok = load_tokenizer(tmp_path)
    assert tok.flavor == "k3"
    with pytest.raises(ChatFormatUnavailable, match=r"lacks chat markers: looked for K3 XTML \(needs <\|open\|>, "
                                                    r".*; absent: <\|close\|>, <\|sep\|>\)$") as e:
        chat_prompt_ids(tok, [{"role": "user", "content": "hi"}])
    assert e.value.missing == {"k3": ("<|close|>", "<|sep|>")}
    (tmp_path / "gpt2").mkdir()
    _gpt2_like(tmp_path / "gpt2")
    with pytest.raises(ChatFormatUnavailable, match="has no chat format") as e:
        chat_format(load_tokenizer(tmp_path / "gpt2"))
    assert set(e.value.missing) == {"k3", "k2"}
