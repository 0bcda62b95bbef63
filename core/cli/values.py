"""Value types of `k3` flags that take vLLM's spellings (argparse `type=` callables).

Each raises argparse.ArgumentTypeError with one sentence naming what is accepted, which
argparse reports as `k3 COMMAND: error: argument --FLAG: ...` with the command's usage.
"""

from __future__ import annotations

import argparse
import json
import re

from k3.dtype_names import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES

_DECIMAL = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12}
_BINARY = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def human_readable_int(value: str) -> int:
    """An integer as vLLM writes token counts: '4096', '32k' (32,000), '25.6k' (25,600),
    '32K' (32,768), '1M' (1,048,576). Lower-case suffixes are powers of ten, upper-case ones
    powers of two (whole numbers only)."""
    text = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if m:
        number, suffix = m.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise argparse.ArgumentTypeError(f"{value!r}: no decimals with the binary suffix {suffix} "
                                             f"(did you mean {number}{suffix.lower()}?)")
        return int(number) * _BINARY[suffix]
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number (e.g. 4096, 32k, 32K, 1M)") from None


def max_model_len(value: str) -> int | None:
    """--max-model-len: a human_readable_int, or 'auto' / -1 (None: the smaller of the
    config's context and what the cache holds, vLLM's auto-fit)."""
    if value.strip().lower() == "auto" or value.strip() == "-1":
        return None
    n = human_readable_int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: must be at least 1 (or auto)")
    return n


def kv_cache_dtype(value: str) -> str:
    """--kv-cache-dtype: k3's format names (auto, bf16, fp8, nvfp4) or vLLM's spellings of
    them (bfloat16, fp8_e4m3), as k3's name."""
    name = KV_CACHE_DTYPE_ALIASES.get(value, value)
    if name not in KV_CACHE_DTYPES:
        known = ", ".join([*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES])
        why = (" (k3 stores fp8 latents as e4m3: use fp8)" if value.startswith("fp8") else "")
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r}{why}; choose from {known}")
    return name


def json_object(value: str) -> dict:
    """A JSON object on the command line ('{"temperature": 0.6}')."""
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at character {e.pos}): {value!r}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {type(obj).__name__}")
    return obj


def positive_int(value: str) -> int:
    """A human_readable_int of at least 1 (token budgets: --max-num-encoder-tokens)."""
    n = human_readable_int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: must be at least 1")
    return n


def non_negative_float(value: str) -> float:
    """A float of at least 0 (sizes in GiB: --mm-processor-cache-gb)."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: not a number") from None
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: must be at least 0")
    return x


def limit_mm_per_prompt(value: str) -> dict:
    """--limit-mm-per-prompt: vLLM's JSON '{"image": N}' (N >= 0; 0: text only)."""
    obj = json_object(value)
    if (set(obj) - {"image"}
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in obj.values())):
        raise argparse.ArgumentTypeError(f'expected {{"image": N}} with N >= 0, got {value!r}')
    return obj
