"""MLA mixer (K3's NoPE gated MLA), sharded by heads; optional DSA indexer (K3.1 Pro).

The latent `[c | k_pe]` (and the DSA index key) of each new token is written into the paged
cache at its position, then queries attend over the cached context: the absorbed (MQA) form
when every sequence brings one generated token (decode), for speculative verification and for
every query under DSA (each reads its own selection of rows), the expanded (MHA) form for dense
prefill and chunked prefill. The two forms round a bf16 model's intermediates at different
points, so the form follows a token's role, never its batch (issue 32). A mixed batch
runs its decodes and its prefill chunks on their own paths (`ForwardMetadata.split_decodes`).
Latents and index keys are replicated across tensor-parallel ranks. Under decode context
parallelism each rank stores only its tokens' records and every query runs on
`k3.model.dcp_attention` (partial attention per rank, log-sum-exp combine).
"""

from __future__ import annotations

import dataclasses

import torch

from k3 import reference as ref
from k3.config import K3Config
from k3.dtypes import compute_dtype, legacy_rounding
from k3.model.metadata import CacheViews, ForwardMetadata, ForwardMode
from k3.plugin.tables import KernelSet

from .dcp_attention import dcp_mla_attention, dcp_token_slots
from .indexer import DSAIndexer
from .latent_store import decode_latent_rows, readable_latents, store_latents
from .lora import apply_lora, has_lora, merged_weight
from .module import K3Module
from .paging import bounded_pages, gather_sequences, token_page_slots
from .parallel import ParallelContext, RowExchange


class MLAMixer(K3Module):
    # the products a LoRA adapter may add to (`k3.model.lora`): q_a (or q), kv_a, the gate g, q_b,
    # kv_b (a merged weight per run of sequences sharing an adapter) and o
    LORA_PARAMS = ("in_proj", "q_b_proj", "kv_b_proj", "o_proj")

    def __init__(self, cfg: K3Config, *, mla_index: int, kernels: KernelSet, parallel: ParallelContext,
                 dtype: torch.dtype, device=None):
        super().__init__()
        self.cfg, self.kernels, self.parallel, self.mla_index = cfg, kernels, parallel, mla_index
        d, heads = cfg.hidden_size, cfg.num_attention_heads
        h0, self.num_heads = parallel.shard(heads, "num_attention_heads")
        hl = self.num_heads
        dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        dqk = dn + dr

        QK, KV, V = ("num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)",
                     "num_attention_heads * (qk_nope_head_dim + v_head_dim)", "num_attention_heads * v_head_dim")

        def by_head(name, per_head, in_dim, dims):
            self.add_weight(name, (hl * per_head, in_dim), dtype, device, full_shape=(heads * per_head, in_dim),
                            shard=(0, h0 * per_head, hl * per_head), dims=dims)

        # Every projection of x fused into one weight (one launch a step), rows in this order: the
        # query's (q_a_proj, or q_proj without a query LoRA), kv_a_proj_with_mqa, the output gate's
        # g_proj when the model has one; `forward` splits the product.
        def head_rows(per_head):
            return (0, h0 * per_head, hl * per_head)

        parts = [("q_a_proj.weight", (cfg.q_lora_rank, d), None, ("q_lora_rank", "hidden_size"))
                 if cfg.q_lora_rank is not None
                 else ("q_proj.weight", (heads * dqk, d), head_rows(dqk), (QK, "hidden_size")),
                 ("kv_a_proj_with_mqa.weight", (r + dr, d), None, ("kv_lora_rank + qk_rope_head_dim", "hidden_size"))]
        if cfg.mla_use_output_gate:
            parts.append(("g_proj.weight", (heads * dv, d), head_rows(dv), (V, "hidden_size")))
        self.in_proj_split = self.add_fused_weight("in_proj", parts, dtype, device)
        if cfg.q_lora_rank is not None:
            self.add_weight("q_a_layernorm", (cfg.q_lora_rank,), dtype, device, dims=("q_lora_rank",))
            by_head("q_b_proj", dqk, cfg.q_lora_rank, (QK, "q_lora_rank"))
        self.add_weight("kv_a_layernorm", (r,), dtype, device, dims=("kv_lora_rank",))
        by_head("kv_b_proj", dn + dv, r, (KV, "kv_lora_rank"))
        self.add_weight("o_proj", (d, hl * dv), dtype, device, full_shape=(d, heads * dv), dims=("hidden_size", V),
                        shard=(1, h0 * dv, hl * dv))
        self.indexer = DSAIndexer(cfg, kernels=kernels, dtype=dtype, device=device) if cfg.uses_dsa else None
        self._absorbed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # (kv_b_proj, w_uk, w_uv)

    def fold_weights(self) -> None:
        """Split kv_b_proj into the absorbed decode weights w_uk [H, Dn, R] and w_uv [H, R, Dv]
        once (`k3.reference.mla_absorb_weights`) instead of in every decode step: two strided
        copies of the whole weight per MLA layer (12.6 MB each at k3-slice's 96 heads: 6 of the 17
        copies that took 0.17 ms of a profiled H200 decode step). Same values; they take the weight's memory once more, and a replaced
        kv_b_proj is split on the fly again."""
        self._absorbed = (self.kv_b_proj, *self._absorb())

    def _absorb(self) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.mla_absorb_weights(self.kv_b_proj, num_heads=self.num_heads,
                                      qk_nope_head_dim=self.cfg.qk_nope_head_dim, v_head_dim=self.cfg.v_head_dim)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_uk, w_uv) of the current kv_b_proj: the folded split when it is still that weight's."""
        if self._absorbed is not None and self._absorbed[0] is self.kv_b_proj:
            return self._absorbed[1], self._absorbed[2]
        return self._absorb()

    def forward(self, x: torch.Tensor, meta: ForwardMetadata, cache: CacheViews,
                *, exchange: RowExchange | None = None, attend=None) -> torch.Tensor:
        """x [T, d] (mixed and normed). Returns [T, d] reduced over ranks.

        exchange: token-sharded prefill (`k3.model.token_sharded`): this call's tokens are one
        rank's pieces of a prompt; every new latent row (and DSA index key) is gathered over the
        ranks before it is written, so the cache holds the whole prompt's rows and the queries
        attend over all the tokens before them. None: the rows written are this call's own.
        attend: a stand-in for the attention step (token-sharded prefill under TP), called as
        attend(self, x, q [T, H_local, Dn + Dr], c_q, cache, pages, offsets) -> [T, H_local, Dv]
        after the latents are written; it writes the DSA index keys itself."""
        cfg, k, t, hl = self.cfg, self.kernels, x.shape[0], self.num_heads
        dn, dr, r, eps = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.rms_norm_eps
        lora, linear = meta.lora, k.dense.linear
        q, kv, *g = apply_lora(self, "in_proj", x, linear(x, self.in_proj), lora).split(self.in_proj_split, -1)
        if cfg.q_lora_rank is not None:
            c_q = k.elementwise.rms_norm(q, self.q_a_layernorm, eps)                 # [T, r_q] (rows strided)
            q = apply_lora(self, "q_b_proj", c_q, linear(c_q, self.q_b_proj), lora)
        else:
            c_q, q = None, q.contiguous()                                       # as its own product gave it
        q = q.view(t, hl, dn + dr)
        row = torch.cat([k.elementwise.rms_norm(kv[:, :r], self.kv_a_layernorm, eps), kv[:, r:]], -1)

        dcp = self.parallel.context_parallel
        if dcp is not None:
            if exchange is not None or attend is not None:
                raise NotImplementedError("token-sharded prefill under decode context parallelism is not built yet")
            o = self._attend_dcp(x, q, c_q, row, meta, cache, dcp)
            return self._output(o, g, x, lora)
        view = cache.latent[self.mla_index]
        pages, offsets = token_page_slots(meta, view.page_size)
        at, rows = (pages, offsets), row
        if exchange is not None:    # the whole prompt's rows, [T_all, R + Dr], at their slots
            at, rows = exchange.slots(view.page_size), exchange.gather(row)
        store_latents(k, view, at, rows)   # as the view stores them: plain, fp8 (per-tensor scale), nvfp4
        if self.indexer is not None and exchange is not None:
            self.indexer.write_keys(x, cache.index_keys[self.mla_index], pages, offsets, exchange=exchange)
        if t == 0:                  # a token-sharded rank without tokens only writes the gathered rows
            return x.new_zeros(0, x.shape[1])

        if attend is not None:
            o = attend(self, x, q, c_q, cache, pages, offsets)
        elif meta.mode is ForwardMode.MIXED and not k.batch_invariant:   # decodes absorbed, prefill chunks expanded
            o = torch.cat([self._attend_adapted(x[cut], q[cut], None if c_q is None else c_q[cut], part, cache,
                                                pages[cut], offsets[cut]) for cut, part in meta.split_decodes()])
        else:
            o = self._attend_adapted(x, q, c_q, meta, cache, pages, offsets, exchange)
        return self._output(o, g, x, lora)

    def _output(self, o: torch.Tensor, g: list[torch.Tensor], x: torch.Tensor, lora=None) -> torch.Tensor:
        """o [T, H, Dv] -> the gated o_proj output [T, d], reduced over tensor-parallel ranks."""
        cfg = self.cfg
        o = o.reshape(x.shape[0], self.num_heads * cfg.v_head_dim)
        if cfg.mla_use_output_gate:   # sigma(g_proj(x)) gates the attention output before o_proj
            cd = compute_dtype(x)             # fp32, fp64 for a float64 model
            gate = self.kernels.elementwise.sigmoid(g[0])
            o = (o.to(cd) * gate).to(x.dtype)
        o = apply_lora(self, "o_proj", o, self.kernels.dense.linear(o, self.o_proj), lora)
        return self.parallel.all_reduce(o)

    def _attend_dcp(self, x: torch.Tensor, q: torch.Tensor, c_q: torch.Tensor | None, row: torch.Tensor,
                    meta: ForwardMetadata, cache: CacheViews, dcp) -> torch.Tensor:
        """Decode context parallelism, every mode: write the owned tokens' latent rows (and index
        keys), select the DSA top-k across the group, attend over this rank's rows and combine
        (`k3.model.dcp_attention`). Returns [T, H, Dv], the same on every DCP rank."""
        cfg, k, dn = self.cfg, self.kernels, self.cfg.qk_nope_head_dim
        view = cache.latent[self.mla_index]
        owned, pages, offsets = dcp_token_slots(meta, view.page_size, dcp)
        mine = row[owned]
        store_latents(k, view, (pages[owned], offsets[owned]), mine)
        dcp.stats.stored_rows += mine.shape[0]
        selected = None
        if self.indexer is not None:
            selected = self.indexer.forward_dcp(x, c_q, meta, cache.index_keys[self.mla_index], owned, pages,
                                                offsets, dcp)
        w_uk, w_uv = self.absorbed_weights()
        kv_pages, kv_scale, table = readable_latents(k, view, meta.block_table, x.dtype)
        if table is not meta.block_table:       # nvfp4: a dense copy of the named pages
            meta = dataclasses.replace(meta, block_table=table)
        return dcp_mla_attention(q[..., :dn], q[..., dn:], w_uk, w_uv, kv_pages, kv_scale, meta, dcp,
                                 scale=cfg.mla_softmax_scale, selected=selected)

    def _attend_adapted(self, x: torch.Tensor, q: torch.Tensor, c_q: torch.Tensor | None, meta: ForwardMetadata,
                        cache: CacheViews, pages: torch.Tensor, offsets: torch.Tensor,
                        exchange: RowExchange | None = None) -> torch.Tensor:
        """`_attend`, with each run of sequences that share a LoRA adapter of kv_b_proj attending
        with that adapter's merged kv_b_proj (W + scale B A): kv_b_proj expands the cached
        latents inside the attention kernels, so it cannot take a per-row delta."""
        lora = meta.lora
        if lora is None or not has_lora(self, "kv_b_proj") or all(s < 0 for s in lora.seq_slots):
            return self._attend(x, q, c_q, meta, cache, pages, offsets, exchange)
        if exchange is not None:
            raise NotImplementedError("LoRA adapters on kv_b_proj with token-sharded prefill are not built yet")
        runs, start = [], 0
        slots = lora.seq_slots
        for n in range(1, len(slots) + 1):
            if n == len(slots) or slots[n] != slots[start]:
                runs.append((start, n))
                start = n
        if len(runs) == 1:
            return self._attend(x, q, c_q, meta, cache, pages, offsets,
                                kv_b=merged_weight(self, "kv_b_proj", self.kv_b_proj, slots[0]))
        out = []
        for lo, hi in runs:
            cut, part = meta.sequences(lo, hi)
            out.append(self._attend(x[cut], q[cut], None if c_q is None else c_q[cut], part, cache, pages[cut],
                                    offsets[cut], kv_b=merged_weight(self, "kv_b_proj", self.kv_b_proj, slots[lo])))
        return torch.cat(out)

    def _attend(self, x: torch.Tensor, q: torch.Tensor, c_q: torch.Tensor | None, meta: ForwardMetadata,
                cache: CacheViews, pages: torch.Tensor, offsets: torch.Tensor,
                exchange: RowExchange | None = None, kv_b: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [T, H, Dn + Dr] over the cached context (this call's latents already
        written): the DSA selection first (writing the index keys), then the absorbed form when
        every sequence brings one token or DSA selects the rows, the expanded form otherwise.
        Returns [T, H, Dv]. kv_b: a kv_b_proj standing in for the layer's (an adapter's merged one)."""
        cfg, k = self.cfg, self.kernels
        dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        view = cache.latent[self.mla_index]
        topk = None
        if self.indexer is not None:
            topk = self.indexer(x, c_q, meta, cache.index_keys[self.mla_index], pages, offsets,
                                keys_written=exchange is not None)
        scale = cfg.mla_softmax_scale
        decode = meta.mode is ForwardMode.DECODE and not k.batch_invariant
        verify = meta.mode is ForwardMode.VERIFY and not legacy_rounding()
        if decode or verify or topk is not None or k.batch_invariant:
            # decode (no host sync), verify, and DSA's sparse prefill: absorbed MQA over the paged
            # cache (under DSA each query reads its own selection, k rows, not the whole context,
            # as DeepSeek V3.2's sparse attention does for prefill too). Verify takes the decode
            # path so that a sequence's token rounds the same whether or not another sequence of
            # its batch verifies drafts (the expanded form rounds keys and values, the absorbed
            # one the query: issue 32); in the batch-invariant mode every query does, so a
            # prefill token attends exactly as its decode did
            w_uk, w_uv = self.absorbed_weights() if kv_b is None else ref.mla_absorb_weights(
                kv_b, num_heads=self.num_heads, qk_nope_head_dim=dn, v_head_dim=cfg.v_head_dim)
            table = meta.block_table
            if decode and meta.context_bound is not None:     # a graph's bound: read only that many positions
                bounded, table = bounded_pages(view.pages, table, meta.context_bound)
                view = dataclasses.replace(view, pages=bounded)
            kv_pages, kv_scale, table = readable_latents(k, view, table, x.dtype)
            return k.mla.decode(q[..., :dn], q[..., dn:], kv_pages, table, meta.seq_lens,
                                w_uk, w_uv, scale=scale, cu_seqlens_q=None if decode else meta.cu_seqlens,
                                kv_cache_scale=kv_scale, topk_indices=topk)
        # dense prefill: expanded MHA over each sequence's whole context
        rows, cu_kv = gather_sequences(view.pages, meta.block_table, meta.seq_lens)
        if view.scale is not None:             # fp8 or nvfp4 rows
            rows = decode_latent_rows(k, view, rows, x.dtype)
        return k.mla.prefill(q, rows[:, :r].to(x.dtype), rows[:, r:].to(x.dtype),
                             self.kv_b_proj if kv_b is None else kv_b,
                             cu_seqlens_q=meta.cu_seqlens, cu_seqlens_kv=cu_kv, scale=scale,
                             qk_nope_head_dim=dn, v_head_dim=cfg.v_head_dim, topk_indices=topk)
