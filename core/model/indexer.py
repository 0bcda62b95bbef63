"""DSA lightning indexer (K3.1 Pro): picks the top-k context tokens each MLA query attends to.

DeepSeek-V3.2's design with K3.1 Pro's numbers and K3's NoPE (DESIGN.md "Decisions"): index
queries from the MLA query latent, one LayerNorm-ed key per token shared by all index heads,
a Hadamard rotation before FP8, per-token FP8 keys (amax / 448) in the cache, head weights
scaled by Hi^-0.5 * D^-0.5, ReLU scores, causal top-k with k = min(index_topk, t + 1).
Replicated on every tensor-parallel rank, like the keys it caches. Under decode context
parallelism (`forward_dcp`) each rank caches its own tokens' keys and the top-k is merged exactly
across the ranks in one 32-bit word a candidate (`k3.model.dcp_topk_packed`).
"""

from __future__ import annotations

import torch

from k3.config import K3Config
from k3.dtypes import compute_dtype
from k3.model.metadata import ForwardMetadata, ForwardMode, IndexKeyCacheView
from k3.plugin.tables import KernelSet

from .dcp_attention import local_rows, local_selection, local_visible, token_sequences
from .dcp_topk_packed import packed_topk
from .module import K3Module
from .paging import bounded_pages, gather_sequences
from .parallel import DecodeContextParallel, RowExchange

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

    def _quantized_keys(self, x: torch.Tensor, fmt: str):
        """The new tokens' index keys [T, D], layer-normed, rotated and quantised to `fmt`."""
        key = self.kernels.elementwise.layer_norm(self.kernels.dense.linear(x, self.wk), self.k_norm_weight,
                                                  self.k_norm_bias,
                                                  INDEX_KEY_NORM_EPS)
        return self.kernels.indexer.quantize_keys(self.kernels.indexer.hadamard(key), fmt=fmt)

    def _project(self, x: torch.Tensor, c_q: torch.Tensor, fmt: str, *, keys: bool = True):
        """(index queries [T, Hi, D], quantised keys of the new tokens (None without `keys`),
        head weights [T, Hi])."""
        cfg, k, t = self.cfg, self.kernels.indexer, x.shape[0]
        hi, dim = cfg.index_n_heads, cfg.index_head_dim
        linear = self.kernels.dense.linear
        q = k.hadamard(linear(c_q, self.wq_b).view(t, hi, dim))
        quantized = self._quantized_keys(x, fmt) if keys else None
        head_weights = linear(x, self.weights_proj).to(compute_dtype(x)) * (hi ** -0.5 * dim ** -0.5)
        return q, quantized, head_weights

    def write_keys(self, x: torch.Tensor, view: IndexKeyCacheView, pages: torch.Tensor, offsets: torch.Tensor,
                   *, exchange: RowExchange | None = None) -> None:
        """Quantise x's [T, d] index keys into the cache at (pages, offsets) [T]; with an
        exchange (token-sharded prefill) the quantised keys of every rank's tokens are gathered
        and the whole prompt's keys written at `exchange.slots` instead."""
        quantized = self._quantized_keys(x, view.fmt)
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
        cfg, k = self.cfg, self.kernels.indexer
        q, quantized, head_weights = self._project(x, c_q, view.fmt, keys=not keys_written)
        if not keys_written:
            view.values[pages, offsets] = quantized.values
            view.scales[pages, offsets] = quantized.scales
        # decode: every sequence's pages, padded and masked (no host sync); the batch-invariant mode
        # scores decodes as prefills (the same entries for both)
        if meta.mode is ForwardMode.DECODE and not self.kernels.batch_invariant:
            values, table = bounded_pages(view.values, meta.block_table, meta.context_bound)
            scales, _ = bounded_pages(view.scales, meta.block_table, meta.context_bound)
            scores = k.paged_decode_scores(q, head_weights, values, scales, table, meta.seq_lens, fmt=view.fmt)
            return k.topk(scores, topk=cfg.index_topk)
        key_values, cu_kv = gather_sequences(view.values, meta.block_table, meta.seq_lens)
        key_scales, _ = gather_sequences(view.scales, meta.block_table, meta.seq_lens)
        keys = k.dequantize_keys(key_values, key_scales, fmt=view.fmt, dtype=compute_dtype(x))
        scores = k.scores(q, head_weights, keys, cu_seqlens_q=meta.cu_seqlens, cu_seqlens_kv=cu_kv)
        return k.topk(scores, topk=cfg.index_topk)

    def forward_dcp(self, x: torch.Tensor, c_q: torch.Tensor, meta: ForwardMetadata, view: IndexKeyCacheView,
                    owned: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor,
                    dcp: DecodeContextParallel) -> torch.Tensor:
        """`forward` under decode context parallelism: write the index keys of the new tokens this
        rank owns (owned [T] bool at pages / offsets, `dcp_token_slots`), score every query
        against this rank's keys (causal in global positions), merge the exact global top-k with
        the group (`packed_topk`: one 32-bit word a candidate, exact). Returns this rank's share of the
        selection: bool [T, Lmax] over its local positions (`local_rows` of the block table)."""
        cfg, k = self.cfg, self.kernels.indexer
        q, quantized, head_weights = self._project(x, c_q, view.fmt)
        view.values[pages[owned], offsets[owned]] = quantized.values[owned]
        view.scales[pages[owned], offsets[owned]] = quantized.scales[owned]
        lens = dcp.local_lens(meta.seq_lens)                                  # [N]
        if meta.mode is ForwardMode.DECODE:   # one query per sequence at its last position: all local keys visible
            scores = k.paged_decode_scores(q, head_weights, view.values, view.scales, meta.block_table, lens,
                                           fmt=view.fmt)                      # [N, Lmax]
        else:                                 # every query against its sequence's local keys, then causal
            values, scales = local_rows(view.values, meta.block_table), local_rows(view.scales, meta.block_table)
            n, lmax = values.shape[:2]
            keys = k.dequantize_keys(values.reshape(n * lmax, -1), scales.reshape(n * lmax, *scales.shape[2:]),
                                     fmt=view.fmt, dtype=compute_dtype(x)).view(n, lmax, -1)
            seq = token_sequences(meta)
            scores = k.decode_scores(q, head_weights, keys[seq], lens[seq])      # [T, Lmax]
            scores = scores.masked_fill(~local_visible(meta, dcp, lmax), float("-inf"))
        result = packed_topk(scores, topk=cfg.index_topk, rank=dcp.rank, world=dcp.size,
                             all_gather=dcp.stack_gather)
        dcp.stats.topk_calls += 1
        dcp.stats.resent_rows += result.resent_rows
        dcp.stats.tie_rows += result.tie_rows
        dcp.stats.topk_wire_bytes += result.wire_bytes
        return local_selection(result.mine, dcp, scores.shape[1])
