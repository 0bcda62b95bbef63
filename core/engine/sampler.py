"""The engine's batched sampler: penalties, token masks, temperature / min-p / top-k / top-p,
seeded draws, logprobs. No host synchronisation, so a decode step can be captured as a graph.

Randomness is counter-based: the noise of request r at output step s for token v is a hash of
(seed_r, s, v), so a seeded request draws the same tokens whatever its batch company, its
position in the batch or the chunking, and nothing needs a per-request torch.Generator.
Drawing is the exponential race argmax p_v / E_v, E_v = -log u_v, which samples exactly p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.ops_helpers import invariant
from k3.reference.sampling import filtered_logits
from k3.structured.bitmask import unpack_bitmask

_MASK64 = (1 << 64) - 1


def _signed(n: int) -> int:
    """A uint64 constant as the int64 torch stores."""
    return n - (1 << 64) if n >= 1 << 63 else n


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (multiplication wraps modulo 2^64)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """u[r, v] in the open interval (0, 1), float64, a pure function of (seeds[r], steps[r], v)."""
    key = _splitmix64(_splitmix64(seeds.long()) ^ steps.long())                        # [B]
    v = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    bits = _shr(_splitmix64(key[:, None] ^ (v[None, :] * _GOLDEN)), 11)                # 53 random bits
    return (bits.double() + 0.5) * 2.0 ** -53


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as device tensors (B rows).

    temperature [B] (0: greedy), top_k [B] (0: off), top_p [B], min_p [B]; seeds [B] int64;
    steps [B] int64 (the row's output index, the noise counter); penalties [B] each;
    token_counts [B, V] int32 output-token counts (presence, frequency) and prompt_mask [B, V]
    bool (tokens seen in the prompt, for the repetition penalty), or None when no row has a
    penalty; logit_bias [B, V] float32 or None (OpenAI logit_bias, added before the penalties,
    as vLLM orders them; zero in rows without one); allowed [B, V] bool or None (logits-processor / min_tokens token mask);
    bitmask [B, ceil(V / 32)] int32 or None: the structured-output grammars' packed token
    bitmask (`k3.structured.bitmask`), unpacked and applied on the device;
    num_logprobs: host int, top logprobs to return (0: only the sampled token's).
    batch_invariant: the batch-invariant mode: every row's log-normaliser, probabilities and
    noise are computed by `k3.ops_helpers.invariant`, a function of that row alone.
    all_greedy, filters_off: host facts about every row (set by the engine from the requests'
    parameters, never read back from the device): every row has temperature 0, or no row
    filters (top-k 0, top-p 1, min-p 0). They select shorter paths that draw the same tokens:
    argmax alone, or the race over softmax(logits / T) without the sort the filters need.
    The draw parameters (temperature, top_k, top_p, min_p, seeds, steps) may be None when
    all_greedy: the argmax reads none of them.
    """

    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    steps: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    token_counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    logit_bias: torch.Tensor | None = None
    allowed: torch.Tensor | None = None
    bitmask: torch.Tensor | None = None
    num_logprobs: int = 0
    all_greedy: bool = False
    filters_off: bool = False
    batch_invariant: bool = False


@dataclass
class SamplerOutput:
    tokens: torch.Tensor              # [B] int64
    logprobs: torch.Tensor            # [B] the sampled tokens' log-probabilities (raw model distribution)
    top_logprobs: torch.Tensor | None  # [B, k] or None
    top_ids: torch.Tensor | None       # [B, k] or None


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """vLLM's penalties: repetition (divide positive / multiply negative logits of every token
    seen in the prompt or output), then presence and frequency (subtract for output tokens)."""
    if b.token_counts is None:
        return logits
    counts = b.token_counts.to(logits.dtype)
    seen_output = counts > 0
    if b.repetition_penalty is not None:
        rep = b.repetition_penalty.to(logits.dtype)[:, None]
        seen = seen_output | (b.prompt_mask if b.prompt_mask is not None else False)
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if b.frequency_penalty is not None:
        logits = logits - b.frequency_penalty.to(logits.dtype)[:, None] * counts
    if b.presence_penalty is not None:
        logits = logits - b.presence_penalty.to(logits.dtype)[:, None] * seen_output.to(logits.dtype)
    return logits


def log_normaliser(logits: torch.Tensor, *, batch_invariant: bool = False) -> torch.Tensor:
    """logsumexp over the vocabulary, [B, V] -> [B]: torch's, or in the batch-invariant mode
    `k3.ops_helpers.invariant.logsumexp` (fixed-order sum, one exp implementation), so a row's
    value does not depend on the rows beside it: a token's log-prob when sampled equals its
    prompt log-prob in a recompute (`k3.engine.prompt_logprobs`) bit for bit."""
    return invariant.logsumexp(logits) if batch_invariant else torch.logsumexp(logits, dim=-1)


def sample_batch(logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
    """Next token of every row. logits [B, V] (fp32 from the model).

    Log-probabilities are of the raw model distribution, logit - logsumexp(logits): one parallel
    reduction per row instead of a log-softmax over the whole vocabulary (a decode step's
    single-row softmax runs on one thread block: 36 us per call at K3's 163,840 tokens on an H200).
    """
    raw = logits.float()
    normaliser = log_normaliser(raw, batch_invariant=b.batch_invariant)                # [B]
    x = raw if b.logit_bias is None else raw + b.logit_bias
    x = apply_penalties(x, b)
    if b.allowed is not None:
        x = x.masked_fill(~b.allowed, float("-inf"))
    if b.bitmask is not None:
        x = x.masked_fill(~unpack_bitmask(b.bitmask, x.shape[1]), float("-inf"))
    if b.all_greedy:
        tokens = x.argmax(dim=-1)
    else:
        greedy = b.temperature <= 0
        temperature = torch.where(greedy, torch.ones_like(b.temperature), b.temperature)
        if b.filters_off:
            drawn_from = x / temperature.unsqueeze(1)
        else:
            drawn_from = filtered_logits(x, temperature=temperature, top_k=b.top_k, top_p=b.top_p, min_p=b.min_p)
        softmax, log = (invariant.softmax, invariant.log) if b.batch_invariant else (torch.softmax, torch.log)
        probs = softmax(drawn_from, -1).double()
        race = -log(uniform_noise(b.seeds, b.steps, x.shape[1]))                        # Exp(1)
        sampled = (probs / race).argmax(dim=-1)
        tokens = torch.where(greedy, x.argmax(dim=-1), sampled)
    chosen = raw.gather(1, tokens[:, None])[:, 0] - normaliser
    top_lp = top_ids = None
    if b.num_logprobs > 0:
        top_values, top_ids = raw.topk(b.num_logprobs, dim=-1)
        top_lp = top_values - normaliser[:, None]
    return SamplerOutput(tokens=tokens, logprobs=chosen, top_logprobs=top_lp, top_ids=top_ids)
