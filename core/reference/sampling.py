"""Token sampling: temperature, min-p, top-k, top-p, per-request seeded generators.

Order (as vLLM applies them): logits / temperature -> min-p -> top-k -> top-p -> sample.
A row with temperature 0 is greedy (argmax, lowest id on ties). Sampling uses the exponential
race (argmax p / E with E ~ Exp(1) drawn from the row's generator), which draws exactly from p
and makes a seeded row reproducible whatever its batch company.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..dtypes import compute_dtype


def _per_row(value: torch.Tensor | float | int | None, rows: int, default: float, device) -> torch.Tensor:
    if value is None:
        value = default
    t = torch.as_tensor(value, device=device)
    return t.expand(rows) if t.dim() == 0 else t


def filtered_logits(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor | float = 1.0,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
    min_p: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Logits of the distribution a sampled row draws from; removed tokens are -inf.

    logits: [B, V]; temperature [B] or scalar (> 0 here; greedy rows are handled by `sample`);
    top_k [B] int (<= 0 or >= V: off); top_p [B] in (0, 1] (1: off); min_p [B] in [0, 1]
    (0: off; keeps tokens with p >= min_p * max p). Returns [B, V] fp32 (fp64 for float64).
    """
    if logits.dim() != 2:
        raise ValueError(f"filtered_logits: logits [B, V] expected, got {tuple(logits.shape)}")
    b, v = logits.shape
    dev = logits.device
    x = logits.to(compute_dtype(logits))
    temp = _per_row(temperature, b, 1.0, dev).to(x.dtype)
    x = x / temp.clamp_min(torch.finfo(x.dtype).tiny).unsqueeze(1)
    neg_inf = torch.tensor(float("-inf"), dtype=x.dtype, device=dev)

    mp = _per_row(min_p, b, 0.0, dev).to(x.dtype)
    probs = torch.softmax(x, dim=-1)
    keep = probs >= mp.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    x = torch.where(keep, x, neg_inf)

    k = _per_row(top_k, b, 0, dev).long()
    k = torch.where((k <= 0) | (k > v), torch.full_like(k, v), k)
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)   # [B, V]
    ranks = torch.arange(v, device=dev).unsqueeze(0)
    sorted_x = torch.where(ranks < k.unsqueeze(1), sorted_x, neg_inf)

    p = _per_row(top_p, b, 1.0, dev).to(x.dtype)
    sorted_probs = torch.softmax(sorted_x, dim=-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs                     # exclusive prefix sum
    sorted_x = torch.where((mass_before < p.unsqueeze(1)) | (ranks == 0), sorted_x, neg_inf)
    return torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)


def sampling_probs(logits: torch.Tensor, **filters) -> torch.Tensor:
    """softmax(filtered_logits(...)): the exact distribution `sample` draws a non-greedy row from."""
    return torch.softmax(filtered_logits(logits, **filters), dim=-1)


def sample(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor | float = 1.0,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
    min_p: torch.Tensor | float | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> torch.Tensor:
    """Next token per row. logits [B, V]; generators: one per row (None: the global RNG).

    Rows with temperature 0 take the argmax of the raw logits. Returns [B] int64.
    """
    b, _ = logits.shape
    temp = _per_row(temperature, b, 1.0, logits.device)
    greedy = temp <= 0
    out = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return out
    probs = sampling_probs(logits, temperature=torch.where(greedy, torch.ones_like(temp), temp),
                           top_k=top_k, top_p=top_p, min_p=min_p)
    race = torch.empty_like(probs)
    for row in range(b):
        gen = None if generators is None else generators[row]
        race[row].exponential_(generator=gen)
    sampled = (probs / race).argmax(dim=-1)
    return torch.where(greedy, out, sampled)
