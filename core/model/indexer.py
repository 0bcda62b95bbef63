"""DSA lightning indexer (K3.1 Pro): picks the top-k context tokens each MLA query attends to.

DeepSeek-V3.2's design with K3.1 Pro's numbers and K3's NoPE (DESIGN.md "Decisions"): index
queries from the MLA query latent, one LayerNorm-ed key per token shared by all index heads,
a Hadamard rotation before FP8, per-token FP8 keys (amax / 448) in the cache, head weights
scaled by Hi^-0.5 * D^-0.5, ReLU scores, causal top-k with k = min(index_topk, t + 1).
Replicated on every tensor-parallel rank, like the keys it caches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.config import K3Config
from k3.dtypes import compute_dtype
from k3.model.metadata import ForwardMetadata, ForwardMode, IndexKeyCacheView
from k3.plugin.tables import KernelSet

from .module import K3Module
from .paging import gather_sequences
from .parallel import RowExchange

INDEX_KEY_NORM_EPS = 1e-6


class DSAIndexer(K3Module):
    def __init__(self, cfg: K3Config, *, kernels: KernelSet, dtype: torch.dtype, device=None):
        super().__init__()
        self.cfg, self.kernels = cfg, kernels
        hi, dim = cfg.index_n_heads, cfg.index_head_dim
        self.add_weight("wq_b", (hi * dim, cfg.q_lora_rank), dtype, device)
        self.add_weight("wk", (dim, cfg.hidden_size), dtype, device)
        self.add_weight("k_norm_weight", (dim,), dtype, device, checkpoint="k_norm.weight")
        self.add_weight("k_norm_bias", (dim,), dtype, device, checkpoint="k_norm.bias")
        self.add_weight("weights_proj", (hi, cfg.hidden_size), dtype, device)

    def write_keys(self, x: torch.Tensor, view: IndexKeyCacheView, pages: torch.Tensor, offsets: torch.Tensor,
                   *, exchange: RowExchange | None = None) -> None:
        """Quantise x's [T, d] index keys into the cache at (pages, offsets) [T]; with an
        exchange (token-sharded prefill) the quantised keys of every rank's tokens are gathered
        and the whole prompt's keys written at `exchange.slots` instead."""
        key = self.kernels.elementwise.layer_norm(F.linear(x, self.wk), self.k_norm_weight, self.k_norm_bias,
                                                  INDEX_KEY_NORM_EPS)
        quantized = self.kernels.indexer.quantize_keys(self.kernels.indexer.hadamard(key), fmt=view.fmt)
        values, scales = quantized.values, quantized.scales
        if exchange is not None:
            pages, offsets = exchange.slots(view.values.shape[1])
            values, scales = exchange.gather(values), exchange.gather(scales)
        view.values[pages, offsets] = values
        view.scales[pages, offsets] = scales

    def forward(self, x: torch.Tensor, c_q: torch.Tensor, meta: ForwardMetadata, view: IndexKeyCacheView,
                pages: torch.Tensor, offsets: torch.Tensor, *, keys_written: bool = False) -> torch.Tensor:
        """Write this step's index keys, return top-k positions [T, index_topk] int32 (-1 pad).

        x [T, d] layer input; c_q [T, q_lora_rank] normed MLA query latent. keys_written: the
        keys are already in the cache (`write_keys` with an exchange: token-sharded prefill).
        """
        cfg, k, t = self.cfg, self.kernels.indexer, x.shape[0]
        hi, dim = cfg.index_n_heads, cfg.index_head_dim
        q = k.hadamard(F.linear(c_q, self.wq_b).view(t, hi, dim))
        if not keys_written:
            self.write_keys(x, view, pages, offsets)
        head_weights = F.linear(x, self.weights_proj).to(compute_dtype(x)) * (hi ** -0.5 * dim ** -0.5)
        if meta.mode is ForwardMode.DECODE:   # decode: every sequence's pages, padded and masked (no host sync)
            scores = k.paged_decode_scores(q, head_weights, view.values, view.scales, meta.block_table,
                                           meta.seq_lens, fmt=view.fmt)
            return k.topk(scores, topk=cfg.index_topk)
        key_values, cu_kv = gather_sequences(view.values, meta.block_table, meta.seq_lens)
        key_scales, _ = gather_sequences(view.scales, meta.block_table, meta.seq_lens)
        keys = k.dequantize_keys(key_values, key_scales, fmt=view.fmt, dtype=compute_dtype(x))
        scores = k.scores(q, head_weights, keys, cu_seqlens_q=meta.cu_seqlens, cu_seqlens_kv=cu_kv)
        return k.topk(scores, topk=cfg.index_topk)
