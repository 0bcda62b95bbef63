"""The prompts of `k3 bench serve`: random ones of a set length, or given ones.

`random_prompts` follows `vllm bench serve --dataset-name random`: each request's input and
output lengths are drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)].
The client has no tokenizer, so a random completions prompt is a list of token ids (the OpenAI
API's `prompt: [int]`) drawn from [0, vocab_size): the default 256 are the byte tokens every
byte-level BPE vocabulary starts with. A chat request needs text: there each prompt is that many
words of a fixed list (its token count is what the server reports in `usage`).
`given_prompts` reads --prompt values or a --dataset-path file (one prompt per line, or JSON lines
with a "prompt" field).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

_WORDS = ("time", "model", "token", "cache", "layer", "state", "serve", "batch", "light", "river", "stone",
          "cloud", "paper", "green", "seven", "north", "quiet", "dance", "window", "garden")


@dataclass(frozen=True)
class BenchPrompt:
    """One request's prompt (text, or token ids), its length when known and its max_tokens."""

    prompt: str | list[int]
    prompt_len: int | None
    output_len: int


def _lengths(rng: random.Random, length: int, ratio: float) -> int:
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.randint(low, high)


def random_prompts(num: int, input_len: int, output_len: int, *, range_ratio: float = 0.0, vocab_size: int = 256,
                   as_text: bool = False, seed: int = 0) -> list[BenchPrompt]:
    """`num` random prompts (token ids, or words when `as_text`); see the module."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1 or vocab_size < 1:
        raise ValueError("--random-input-len, --random-output-len and --random-vocab-size must be at least 1")
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in, n_out = _lengths(rng, input_len, range_ratio), _lengths(rng, output_len, range_ratio)
        if as_text:
            out.append(BenchPrompt(" ".join(rng.choice(_WORDS) for _ in range(n_in)), None, n_out))
        else:
            out.append(BenchPrompt([rng.randrange(vocab_size) for _ in range(n_in)], n_in, n_out))
    return out


def given_prompts(num: int, output_len: int, *, prompts: list[str] | None = None,
                  dataset_path: str | None = None) -> list[BenchPrompt]:
    """`num` requests cycling through the given prompts (--prompt values, else the file's)."""
    texts = list(prompts or [])
    if dataset_path is not None:
        for line in Path(dataset_path).read_text().splitlines():
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    texts.append(str(json.loads(line)["prompt"]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"{dataset_path}: a JSON line without a \"prompt\" field: {line[:80]!r}") from None
            else:
                texts.append(line)
    if not texts:
        raise ValueError("no prompts: give --prompt TEXT or a --dataset-path file with one prompt per line")
    return [BenchPrompt(texts[i % len(texts)], None, output_len) for i in range(num)]
