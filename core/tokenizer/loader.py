"""`load_tokenizer(model_dir)`: pick the vocabulary source a checkpoint directory ships."""

from __future__ import annotations

import sys
from pathlib import Path

from k3.tokenizer.base import Tokenizer
from k3.tokenizer.compact import VOCAB_SIZE as COMPACT_VOCAB_SIZE, compact_tokenizer
from k3.tokenizer.hf_vocab import TOKENIZER_JSON, HFTokenizer
from k3.tokenizer.tiktoken_vocab import CONFIG_FILE, TIKTOKEN_FILE, load_tiktoken_dir, read_json

_NOTIFIED: set[Path] = set()


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint directory, from the first source it has:

    a. `tiktoken.model` + `tokenizer_config.json` (Kimi K3 / K2 checkpoints);
    b. `tokenizer.json` (byte-level BPE through HF `tokenizers`);
    c. none: the built-in compact vocabulary, flavor from `config.json` (`model_type`
       "kimi_k3" -> "k3", flat "kimi_linear" -> "k2"). Allowed only when the config's
       vocab_size is the compact one (512); says so once per directory on stderr.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: no such checkpoint directory")
    if (model_dir / TIKTOKEN_FILE).is_file():
        return load_tiktoken_dir(model_dir)
    if (model_dir / TOKENIZER_JSON).is_file():
        return HFTokenizer(model_dir / TOKENIZER_JSON)
    flavor = _compact_flavor(model_dir)
    key = model_dir.resolve()
    if key not in _NOTIFIED:
        _NOTIFIED.add(key)
        print(f"k3: {model_dir} has no tokenizer files; using the built-in compact vocabulary "
              f"(flavor {flavor})", file=sys.stderr)
    return compact_tokenizer(flavor)


def _compact_flavor(model_dir: Path) -> str:
    config_path = model_dir / "config.json"
    none = (f"{model_dir}: no tokenizer ({TIKTOKEN_FILE} + {CONFIG_FILE}, or {TOKENIZER_JSON})")
    if not config_path.is_file():
        raise FileNotFoundError(f"{none} and no config.json to pick the built-in compact vocabulary by")
    config = read_json(config_path)
    model_type = config.get("model_type")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if model_type == "kimi_k3":
        flavor = "k3"
    elif model_type == "kimi_linear" and "text_config" not in config:
        flavor = "k2"
    else:
        raise FileNotFoundError(f"{none}, and {config_path} model_type {model_type!r} has no built-in "
                                f"vocabulary (kimi_k3 -> k3, flat kimi_linear -> k2)")
    vocab = text.get("vocab_size")
    if vocab != COMPACT_VOCAB_SIZE:
        raise FileNotFoundError(f"{none}, and {config_path} vocab_size {vocab} is not the built-in compact "
                                f"vocabulary's {COMPACT_VOCAB_SIZE}")
    return flavor
