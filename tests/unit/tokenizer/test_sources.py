"""load_tokenizer's three sources, their precedence, and clear errors on bad files."""

import base64
import json

import pytest
from tokenizers import Tokenizer as HFCore, decoders, models, pre_tokenizers, trainers

from k3.presets import preset_dict
from k3.tokenizer import compact_tokenizer, load_tokenizer, write_compact_tokenizer
from k3.tokenizer.hf_vocab import HFTokenizer
from k3.tokenizer.tiktoken_vocab import TiktokenTokenizer


def _write_tiktoken(d, tokens, added):
    (d / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    decoder = {str(i): {"content": name, "special": True} for i, name in added.items()}
    (d / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))


SMALL = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world"]


def test_tiktoken_model_built_here_loads_through_path_a(tmp_path):
    n = len(SMALL)   # 265 regular tokens; specials from 265, two unnamed slots in between
    _write_tiktoken(tmp_path, SMALL, {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|end_of_msg|>",
                                      n + 3: "<|open|>", n + 6: "[PAD]"})
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.flavor == "k3" and tok.vocab_size == n + 7
    assert tok.special_tokens[f"<|reserved_token_{n + 4}|>"] == n + 4
    assert tok.encode("hello world") == [n - 6, n - 1]
    assert tok.encode("[BOS]hello<|open|>x<|end_of_msg|>") == [n, n - 6, n + 3, ord("x"), n + 2]
    assert tok.eos_ids == (n + 2, n + 1) and tok.pad_id == n + 6 and tok.bos_id == n
    assert tok.decode(tok.encode("hello 世界 😀[PAD]")) == "hello 世界 😀[PAD]"


def test_tokenizer_json_built_here_loads_through_path_b(tmp_path):
    """A byte-level BPE file trained by `tokenizers` itself, with K2 special tokens."""
    core = HFCore(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<think>", "[PAD]"]
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    core.train_from_iterator(["hello world, the model thinks", "你好世界 the answer"] * 20, trainer)
    core.add_special_tokens(specials)
    core.save(str(tmp_path / "tokenizer.json"))

    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and tok.flavor == "k2"
    for name in specials:
        assert tok.token_id(name) == core.token_to_id(name)
    text = "hello world, 你好 😀 the answer"
    assert tok.encode(text) == core.encode(text).ids
    mixed = f"<|im_user|>{text}<|im_end|><think>"
    assert tok.encode(mixed) == core.encode(mixed).ids
    assert tok.decode(tok.encode(mixed)) == mixed
    assert tok.eos_ids == (core.token_to_id("<|im_end|>"), core.token_to_id("[EOS]"))


def test_tiktoken_files_win_over_tokenizer_json(tmp_path):
    write_compact_tokenizer(tmp_path, flavor="k3")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert isinstance(load_tokenizer(tmp_path), TiktokenTokenizer)


@pytest.mark.parametrize("preset,flavor", [("k3-tiny", "k3"), ("kimi-linear-tiny", "k2")])
def test_fallback_to_compact_says_so_once(tmp_path, capsys, preset, flavor):
    (tmp_path / "config.json").write_text(json.dumps(preset_dict(preset)))
    assert load_tokenizer(tmp_path) is compact_tokenizer(flavor)
    err = capsys.readouterr().err
    assert "built-in compact vocabulary" in err and f"flavor {flavor}" in err
    assert load_tokenizer(tmp_path) is compact_tokenizer(flavor)
    assert capsys.readouterr().err == ""


def test_fallback_needs_a_compact_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(preset_dict("kimi-k3")))
    with pytest.raises(FileNotFoundError, match="vocab_size 163840"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        load_tokenizer(tmp_path / "missing")


def test_malformed_tiktoken_model_names_file_and_line(tmp_path):
    _write_tiktoken(tmp_path, SMALL, {len(SMALL): "[BOS]"})
    lines = (tmp_path / "tiktoken.model").read_text().splitlines()
    lines[2] = "!!notbase64 2"
    (tmp_path / "tiktoken.model").write_text("\n".join(lines))
    with pytest.raises(ValueError, match=r"tiktoken\.model:3: malformed"):
        load_tokenizer(tmp_path)
    lines[2] = "QQ=="
    (tmp_path / "tiktoken.model").write_text("\n".join(lines))
    with pytest.raises(ValueError, match=r"tiktoken\.model:3: expected"):
        load_tokenizer(tmp_path)
    del lines[2]
    (tmp_path / "tiktoken.model").write_text("\n".join(lines))
    with pytest.raises(ValueError, match=r"rank 2 is missing"):
        load_tokenizer(tmp_path)


def test_malformed_tokenizer_config_names_file_and_line(tmp_path):
    _write_tiktoken(tmp_path, SMALL, {len(SMALL): "[BOS]"})
    (tmp_path / "tokenizer_config.json").write_text('{\n  "added_tokens_decoder": {\n    "1": \n}')
    with pytest.raises(ValueError, match=r"tokenizer_config\.json:4:\d+: malformed JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"5": {"content": "[BOS]"}}}))
    with pytest.raises(ValueError, match="inside the regular vocabulary"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer_config.json"):
        load_tokenizer(tmp_path)


def test_tokenizer_without_kimi_specials_loads_without_a_chat_format(tmp_path):
    _write_tiktoken(tmp_path, SMALL, {len(SMALL): "<|endoftext|>"})
    tok = load_tokenizer(tmp_path)
    assert tok.flavor is None and tok.bos_id is None and tok.pad_id is None and tok.eos_ids == ()
    assert tok.missing_chat_markers()["k3"] == ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")


def test_write_compact_refuses_a_conflicting_file(tmp_path):
    write_compact_tokenizer(tmp_path, flavor="k3")
    with pytest.raises(FileExistsError, match="tiktoken.model"):
        write_compact_tokenizer(tmp_path, flavor="k2")
    with pytest.raises(ValueError, match="unknown tokenizer flavor"):
        write_compact_tokenizer(tmp_path / "x", flavor="k4")


def test_vocabulary_missing_single_bytes_is_refused(tmp_path):
    _write_tiktoken(tmp_path, [b for b in SMALL if b != b"Z"], {len(SMALL) - 1: "[BOS]"})
    with pytest.raises(ValueError, match=r"256 bytes; 1 are missing, e.g. b'Z'"):
        load_tokenizer(tmp_path)
