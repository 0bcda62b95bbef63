"""`load_tokenizer(model_dir)`: pick the vocabulary source a checkpoint directory ships."""

from __future__ import annotations

from pathlib import Path

from k3.log import get_logger
from k3.tokenizer import specials
from k3.tokenizer.base import Tokenizer
from k3.tokenizer.byte_bpe import NotByteLevel
from k3.tokenizer.compact import VOCAB_SIZE as COMPACT_VOCAB_SIZE, compact_tokenizer
from k3.tokenizer.hf_vocab import TOKENIZER_JSON, HFTokenizer
from k3.tokenizer.hf_wrapped import WrappedHFTokenizer
from k3.tokenizer.tiktoken_vocab import CONFIG_FILE, TIKTOKEN_FILE, load_tiktoken_dir, read_json

logger = get_logger(__name__)

_NOTIFIED: set[Path] = set()


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint directory, from the first source it has:

    a. `tiktoken.model` + `tokenizer_config.json` (Kimi K3 / K2 checkpoints);
    b. `tokenizer.json`: byte-level BPE through k3's byte-level machinery, any other kind
       (Metaspace / sentencepiece-style, WordPiece, ...) wrapped whole (`WrappedHFTokenizer`);
    c. none: the built-in compact vocabulary, flavor from `config.json` (`model_type`
       "kimi_k3" -> "k3", flat "kimi_linear" -> "k2"). Allowed only when the config's
       vocab_size is the compact one (512); says so once per directory on stderr.

    Special tokens need not include Kimi's: BOS / EOS / PAD are the tokens
    `tokenizer_config.json` names (`bos_token`, ...), else `[BOS]` / `[EOS]` / `[PAD]`, else
    none; without a named EOS, generations end at the `eos_token_id` of generation_config.json
    or config.json. A tokenizer with no chat markers loads (its `flavor` is None): chat
    requests are then refused, completions work.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: no such checkpoint directory")
    if (model_dir / TIKTOKEN_FILE).is_file():
        return load_tiktoken_dir(model_dir, roles=_roles(model_dir), eos_fallback=_config_eos(model_dir))
    if (model_dir / TOKENIZER_JSON).is_file():
        path = model_dir / TOKENIZER_JSON
        data, roles, eos = read_json(path), _roles(model_dir), _config_eos(model_dir)
        try:
            return HFTokenizer(path, data=data, roles=roles, eos_fallback=eos)
        except NotByteLevel:
            return WrappedHFTokenizer(path, data=data, roles=roles, eos_fallback=eos)
    flavor = _compact_flavor(model_dir)
    key = model_dir.resolve()
    if key not in _NOTIFIED:
        _NOTIFIED.add(key)
        logger.warning(f"{model_dir} has no tokenizer files; using the built-in compact vocabulary "
                       f"(flavor {flavor})")
    return compact_tokenizer(flavor)


def _roles(model_dir: Path) -> dict[str, str]:
    """role -> token name from tokenizer_config.json's `bos_token` / `eos_token` / `pad_token`
    (a string or an `{"content": ...}` object); empty without the file."""
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        return {}
    config = read_json(path)
    roles = {}
    for role in specials.ROLES:
        value = config.get(f"{role}_token")
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{path}: {role}_token must be a token name, got {value!r}")
        if value:
            roles[role] = value
    return roles


def _config_eos(model_dir: Path) -> tuple[int, ...]:
    """`eos_token_id` (an id or a list) of generation_config.json, else of config.json (its
    text_config first); () when neither names one."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        config = read_json(path)
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        value = text.get("eos_token_id", config.get("eos_token_id"))
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {value!r}")
        return tuple(ids)
    return ()


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
