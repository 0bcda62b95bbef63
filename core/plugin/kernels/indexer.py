"""DSA lightning indexer kernel entries (DeepSeek-V3.2's design, K3.1 Pro's numbers, NoPE):
`IndexerKernels`.

Per token the model builds q = Hadamard(wq_b c_q) `[T, Hi, D]`, k = Hadamard(LayerNorm(wk x))
`[S, D]` and head weights w = weights_proj(x) * Hi^-0.5 * D^-0.5 `[T, Hi]`; keys are cached
quantised (fp8 e4m3fn with one fp32 scale per token, amax / 448, or MXFP4) and scored as

    I(t, s) = sum_h w[t, h] * ReLU(q[t, h] . k[s]),   causal (MLA's varlen rule),

then the top-k positions per query restrict MLA. With `quantize_query` the query is rounded to
fp8 e4m3fn per (token, head) with scale amax / 448 and the scale folded into the head weight
(DeepSeek-V3.2's `act_quant` + `fp8_index`). Scores are fp32 (fp64 for float64 inputs) with
-inf where a position is not selectable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class QuantizedKeys:
    """fmt "fp8": values float8_e4m3fn `[S, D]`, scales fp32 `[S]` (amax / 448 per token);
    fmt "mxfp4": values uint8 `[S, D/2]` (element 2i in the low nibble), scales uint8 E8M0
    `[S, D/32]`."""

    values: Tensor
    scales: Tensor


class IndexerQuantizeKeys(Protocol):
    """`indexer.quantize_keys`: index keys k `[S, D]` (any float dtype) for the cache, fmt "fp8"
    or "mxfp4"; the division in fp32 (fp64 for float64). Bit-exact with `k3.quant`'s codecs.
    Returns `QuantizedKeys`."""

    def __call__(self, k: Tensor, *, fmt: str = "fp8") -> QuantizedKeys: ...


class IndexerDequantizeKeys(Protocol):
    """`indexer.dequantize_keys`: the inverse of `quantize_keys`: values and scales as
    `QuantizedKeys`, fmt -> keys `[S, D]` in `dtype`, multiplied in fp32 (fp64 for float64)."""

    def __call__(self, values: Tensor, scales: Tensor, *, fmt: str, dtype: torch.dtype = torch.float32) -> Tensor: ...


class IndexerScores(Protocol):
    """`indexer.scores`: the varlen prefill form.

    q `[T, Hi, D]` (Hadamard-rotated); head_weights `[T, Hi]`; keys `[S, D]` dequantised;
    cu_seqlens_q / cu_seqlens_kv int `[N+1]` (MLA's varlen rule), read on the host;
    quantize_query. Returns `[T, max kv_len]`, -inf after the query's own position and past its
    sequence's kv.
    """

    def __call__(self, q: Tensor, head_weights: Tensor, keys: Tensor, *, cu_seqlens_q: Tensor,
                 cu_seqlens_kv: Tensor, quantize_query: bool = True) -> Tensor: ...


class IndexerDecodeScores(Protocol):
    """`indexer.decode_scores`: one query per sequence (its last token) over padded keys.

    q `[N, Hi, D]`; head_weights `[N, Hi]`; keys `[N, L, D]` dequantised, in position order, any
    padding after seq_lens[n]; seq_lens int `[N]`; quantize_query. Returns `[N, L]`, -inf at
    positions >= seq_lens[n]. No host synchronisation.
    """

    def __call__(self, q: Tensor, head_weights: Tensor, keys: Tensor, seq_lens: Tensor, *,
                 quantize_query: bool = True) -> Tensor: ...


class IndexerPagedDecodeScores(Protocol):
    """`indexer.paged_decode_scores`: `decode_scores` reading the quantised keys from the index-key
    cache pages through the block table (what the model's decode step calls).

    q `[N, Hi, D]`; head_weights `[N, Hi]`; key_values, key_scales: the cache pages as
    `quantize_keys` writes them per token (fp8: values `[P, page, D]`, scales `[P, page]`;
    mxfp4: `[P, page, D/2]` and `[P, page, D/32]`), any strides; block_table int
    `[N, max_pages]`; seq_lens `[N]`; fmt; quantize_query. Keys are dequantised in the compute
    dtype of q and head_weights. Returns `[N, max_pages * page]`, -inf at positions >=
    seq_lens[n] (pages past a sequence may hold anything). No host synchronisation.
    """

    def __call__(self, q: Tensor, head_weights: Tensor, key_values: Tensor, key_scales: Tensor, block_table: Tensor,
                 seq_lens: Tensor, *, fmt: str, quantize_query: bool = True) -> Tensor: ...


class IndexerTopK(Protocol):
    """`indexer.topk`: the exact top-k of each row's finite scores.

    scores `[T, L]` (non-finite = not selectable); topk a positive int. Returns int32
    `[T, topk]`: descending score, ties to the lower position, -1 padding (a causal row t has
    only t+1 finite entries).
    """

    def __call__(self, scores: Tensor, *, topk: int) -> Tensor: ...


class HadamardTransform(Protocol):
    """`indexer.hadamard`: y = x H_n / sqrt(n) over the last axis, H_n the Sylvester Hadamard
    matrix in natural order (H_2n = [[H_n, H_n], [H_n, -H_n]], as DeepSeek-V3.2's
    `fast_hadamard_transform`); orthonormal and its own inverse. x `[..., n]`, n a power of
    two; computed in fp32 (fp64 for float64), returns x.dtype."""

    def __call__(self, x: Tensor) -> Tensor: ...
