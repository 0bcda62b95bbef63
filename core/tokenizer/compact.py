"""Source (c): the compact vocabulary of the tiny checkpoints, built in code.

Layout (512 ids, mirroring the real vocabulary's shape at a small size):
- 0..255: the 256 single bytes (id = byte value);
- 256..383: 128 BPE merges learned from `compact_sample.SAMPLE` (deterministic, see below);
- 384..509: the Kimi special slots 163584..163709 (id = 384 + kimi_id - 163584);
- 510, 511: [UNK] (163838) and [PAD] (163839).
Special slots carry the K3 names (flavor "k3") or the K2 names (flavor "k2") of
`specials.py`; unnamed slots are `<|reserved_token_KIMI_ID|>`, as in the real vocabulary.

Merges are learned by plain BPE over the sample's pre-tokenised pieces (most frequent pair
first; ties broken by the pair's bytes), skipping any pair whose token would be *ambiguous*:
a token that a second pair of vocabulary tokens also concatenates to, or that BPE would not
rebuild from its own bytes. Without ambiguity, tiktoken's rule (merge the adjacent pair whose
concatenation has the lowest rank) and the `tokenizers` rule (merge the listed pair with the
lowest merge rank) pick the same merges, so the `tiktoken.model` and `tokenizer.json` forms
of this vocabulary give the same ids for every text.
"""

from __future__ import annotations

import sys
from collections import Counter
from functools import lru_cache
from pathlib import Path

from k3.tokenizer import specials
from k3.tokenizer.compact_sample import SAMPLE
from k3.tokenizer.hf_vocab import TOKENIZER_JSON, write_tokenizer_json
from k3.tokenizer.pretokenize import PATTERN
from k3.tokenizer.tiktoken_vocab import TIKTOKEN_FILE, TiktokenTokenizer, write_tiktoken_dir

NUM_BYTES = 256
NUM_MERGES = 128
NUM_REGULAR = NUM_BYTES + NUM_MERGES          # 384
VOCAB_SIZE = 512
_LOW_SLOTS = VOCAB_SIZE - NUM_REGULAR - 2      # 126 slots from 163584; then [UNK], [PAD]


def compact_id(kimi_id: int) -> int:
    """Compact id of a Kimi special-token id (163584..163709, 163838, 163839)."""
    offset = kimi_id - specials.KIMI_SPECIAL_BASE
    if 0 <= offset < _LOW_SLOTS:
        return NUM_REGULAR + offset
    if specials.KIMI_VOCAB_SIZE - 2 <= kimi_id < specials.KIMI_VOCAB_SIZE:
        return VOCAB_SIZE - (specials.KIMI_VOCAB_SIZE - kimi_id)
    raise ValueError(f"Kimi special id {kimi_id} has no slot in the compact vocabulary")


def kimi_id(compact: int) -> int:
    """Inverse of `compact_id` for the special ids 384..511."""
    if NUM_REGULAR <= compact < NUM_REGULAR + _LOW_SLOTS:
        return specials.KIMI_SPECIAL_BASE + compact - NUM_REGULAR
    if VOCAB_SIZE - 2 <= compact < VOCAB_SIZE:
        return specials.KIMI_VOCAB_SIZE - (VOCAB_SIZE - compact)
    raise ValueError(f"compact id {compact} is not a special slot ({NUM_REGULAR}..{VOCAB_SIZE - 1})")


def compact_special_tokens(flavor: str) -> dict[str, int]:
    """Special-token table (name -> compact id) of one flavor."""
    if flavor not in specials.FLAVORS:
        raise ValueError(f"unknown tokenizer flavor {flavor!r}; known: {', '.join(specials.FLAVORS)}")
    names = specials.KIMI_SPECIALS[flavor]
    table = {}
    for i in range(NUM_REGULAR, VOCAB_SIZE):
        k = kimi_id(i)
        table[names.get(k, specials.reserved_name(k))] = i
    return table


@lru_cache(maxsize=1)
def compact_merges() -> tuple[tuple[bytes, bytes], ...]:
    """The 128 merges, in rank order (merge i makes token 256 + i)."""
    import regex   # tiktoken's own dependency; `re` lacks \p{Han} and class intersection

    words = Counter(p.encode("utf-8") for p in regex.findall(PATTERN, SAMPLE, flags=regex.V1))
    seqs = [[bytes([b]) for b in w] for w in words]
    weights = list(words.values())
    ranks = {bytes([b]): b for b in range(NUM_BYTES)}
    merges: list[tuple[bytes, bytes]] = []
    while len(merges) < NUM_MERGES:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for seq, w in zip(seqs, weights):
            for pair in zip(seq, seq[1:]):
                pairs[pair] += w
        order = sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0][0] + kv[0][1], kv[0]))
        pair = next((p for p, _ in order if _unambiguous(*p, ranks)), None)
        if pair is None:
            raise RuntimeError(f"the compact sample yields only {len(merges)} unambiguous merges")
        a, b = pair
        ranks[a + b] = len(ranks)
        merges.append(pair)
        seqs = [_merge_pair(seq, a, b) for seq in seqs]
    return tuple(merges)


def compact_regular_tokens() -> list[bytes]:
    """Bytes of ids 0..383."""
    return [bytes([b]) for b in range(NUM_BYTES)] + [a + b for a, b in compact_merges()]


@lru_cache(maxsize=None)
def compact_tokenizer(flavor: str) -> TiktokenTokenizer:
    """The built-in compact tokenizer of a flavor ("k3" or "k2"); one shared instance each."""
    return TiktokenTokenizer(compact_regular_tokens(), compact_special_tokens(flavor),
                             source=f"built-in compact vocabulary ({flavor})")


def write_compact_tokenizer(model_dir: str | Path, *, flavor: str) -> list[Path]:
    """Write the compact vocabulary into a checkpoint directory: `tiktoken.model` +
    `tokenizer_config.json` for flavor "k3", `tokenizer.json` for flavor "k2". Loading the
    directory back gives the same ids as `compact_tokenizer(flavor)` for every text.
    Returns the paths written."""
    model_dir = Path(model_dir)
    table = compact_special_tokens(flavor)
    model_dir.mkdir(parents=True, exist_ok=True)
    other = model_dir / (TOKENIZER_JSON if flavor == "k3" else TIKTOKEN_FILE)
    if other.exists():
        raise FileExistsError(f"{other} exists; remove it before writing the {flavor} compact tokenizer "
                              f"(load_tokenizer would read the wrong vocabulary)")
    if flavor == "k3":
        extra = {"bos_token": specials.BOS, "eos_token": specials.EOS, "pad_token": specials.PAD,
                 "unk_token": specials.UNK}
        return write_tiktoken_dir(model_dir, compact_regular_tokens(), table, extra_config=extra)
    return [write_tokenizer_json(model_dir / TOKENIZER_JSON, compact_regular_tokens(), compact_merges(),
                                 table, pattern=PATTERN)]


def _unambiguous(a: bytes, b: bytes, ranks: dict[bytes, int]) -> bool:
    """Whether token a+b can join the vocabulary `ranks` without ambiguity (module docstring)."""
    t = a + b
    if t in ranks:
        return False
    if any(k != len(a) and t[:k] in ranks and t[k:] in ranks for k in range(1, len(t))):
        return False   # a second pair already concatenates to t
    for s in ranks:    # t must not give an existing token a second split
        if len(s) > len(t) and ((s.startswith(t) and s[len(t):] in ranks) or
                                (s.endswith(t) and s[:-len(t)] in ranks)):
            return False
    return bpe(t, {**ranks, t: len(ranks)}) == [t]


def bpe(piece: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """tiktoken's BPE rule in Python: merge the adjacent pair whose concatenation has the
    lowest rank (leftmost on ties) until none is in `ranks`."""
    parts = [bytes([c]) for c in piece]
    while len(parts) > 1:
        best = min(((ranks.get(parts[i] + parts[i + 1], sys.maxsize), i) for i in range(len(parts) - 1)))
        if best[0] == sys.maxsize:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def _merge_pair(seq: list[bytes], a: bytes, b: bytes) -> list[bytes]:
    out: list[bytes] = []
    i = 0
    while i < len(seq):
        if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out
