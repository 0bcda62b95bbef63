"""Pre-tokenisation: how text is cut into pieces before BPE runs inside each piece.

`PATTERN` follows the splitting rules of Moonshot's Kimi tokenizers, which a real checkpoint's
ids depend on (a different split gives different, though decodable, ids):

- a run of Han characters is one piece, and Han never joins a Latin word;
- a word is an optional leading non-letter, non-digit character (typically a space), then
  letters in the cased shapes "Word" / "word" or "WORD", then an optional English contraction;
- digits go in groups of at most three;
- a run of punctuation / symbols takes an optional leading space and its trailing newlines;
- newlines take the whitespace before them; other whitespace leaves its last space to the next
  word.

The pattern is written for the `regex` dialects of tiktoken (Rust `fancy-regex`) and of HF
`tokenizers` (Oniguruma): both understand `\\p{Han}` and class intersection `[A&&[^B]]`.
(Python's `regex` module needs `flags=regex.V1` for the intersection.)
"""

from __future__ import annotations

import re

_NOT_HAN = r"&&[^\p{Han}]"
# Letters that may open a word (upper / title / modifier / other letters and marks) ...
_WORD_HEAD = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}" + _NOT_HAN + "]"
# ... and letters that continue it (lower / modifier / other letters and marks).
_WORD_TAIL = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}" + _NOT_HAN + "]"
_LEAD = r"[^\r\n\p{L}\p{N}]?"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"

PATTERN = "|".join([
    r"\p{Han}+",
    _LEAD + _WORD_HEAD + "*" + _WORD_TAIL + "+" + _CONTRACTION,   # Word, word
    _LEAD + _WORD_HEAD + "+" + _WORD_TAIL + "*" + _CONTRACTION,   # WORD
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# tiktoken's regex overflows its stack on very long runs of whitespace (tiktoken issue 195);
# Kimi's tokenizers cut every run of whitespace or of non-whitespace after this many characters.
MAX_RUN = 25_000
_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (MAX_RUN + 1, MAX_RUN + 1))


def split_for_encoding(text: str) -> list[str]:
    """Cut `text` so that no piece holds a run of more than MAX_RUN whitespace characters or
    MAX_RUN non-whitespace characters; each long run is cut every MAX_RUN characters from its
    start. Text without such runs comes back whole (and encodes exactly as it would uncut)."""
    if len(text) <= MAX_RUN:
        return [text]
    cuts = [cut for m in _LONG_RUN.finditer(text) for cut in range(m.start() + MAX_RUN, m.end(), MAX_RUN)]
    if not cuts:
        return [text]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]
