"""Token-sharded MLA attention inside a tensor-parallel group (the seed's heads <-> tokens
re-layout; `k3.model.token_sharded` for the piece rule and the TP = 1 prefill).

Under TP every rank holds all the prompt's tokens for its H / W heads, and every rank's cache
holds every latent (latents are replicated). A plain TP prefill has each rank attend with all T
queries of its heads, each rank reading the whole latent context for its heads. Here each
rank attends for its own pieces' queries with ALL heads instead (causal load balance by the
piece pairs; each latent row read once for every head):

1. every rank absorbs its heads' queries into the latent space (q_nope w_uk: [T, H_local,
   R], beside q_pe [T, H_local, Dr]) and an all-to-all sends each rank the rows of its pieces'
   tokens: [T_mine, H, R + Dr] (tokens <-> heads);
2. it attends over the cached latents with the absorbed form (`mla.decode` with identity
   up-projections: the latent output [T_mine, H, R]), the DSA selection computed for its
   tokens only;
3. a second all-to-all returns the latent outputs to the head layout, [T, H_local, R], and
   each rank applies its heads' w_uv. The output gate, o_proj and its all-reduce follow in
   the layer as in TP.

KDA layers, norms and the FFN run as in a TP prefill (all tokens, heads / widths sharded):
no state chaining is needed. Bytes moved per token per MLA layer: H (R + Dr) words out and H R
back, spread over the ranks.
"""

from __future__ import annotations

import torch

from k3.model.metadata import CacheViews, ForwardMetadata, ForwardMode

from .latent_store import readable_latents
from .mla import MLAMixer


class HeadsTokensAttention:
    """The `attend` stand-in of `MLAMixer.forward` for one token-sharded TP prefill.

    tokens: [T_r] token indices of each rank r of the TP group (its pieces, ascending);
    meta_mine: the metadata of this rank's pieces (one sequence each; None: no token here)."""

    def __init__(self, tokens: list[torch.Tensor], rank: int, meta_mine: ForwardMetadata | None):
        self.tokens, self.rank, self.meta_mine = tokens, rank, meta_mine
        self.counts = [len(t) for t in tokens]
        self.order = torch.cat(tokens)                                          # gathered row -> token
        self.bytes_moved = 0

    def _all_to_all(self, mixer: MLAMixer, x: torch.Tensor, out_splits, in_splits) -> torch.Tensor:
        out = mixer.parallel.collectives.all_to_all_single(x.contiguous(), out_splits, in_splits)
        self.bytes_moved += out.numel() * out.element_size()
        return out

    def __call__(self, mixer: MLAMixer, x: torch.Tensor, q: torch.Tensor, c_q: torch.Tensor | None,
                 cache: CacheViews, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        cfg, k = mixer.cfg, mixer.kernels
        dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        world, hl = mixer.parallel.world_size, mixer.num_heads
        view = cache.latent[mixer.mla_index]
        mine = self.tokens[self.rank].to(x.device)
        if mixer.indexer is not None:       # every rank holds every token: it writes every key
            mixer.indexer.write_keys(x, cache.index_keys[mixer.mla_index], pages, offsets)
        w_uk, w_uv = mixer.absorbed_weights()                                   # [H_local, Dn, R], [H_local, R, Dv]
        q_lat = torch.einsum("thd,hdr->thr", q[..., :dn], w_uk.to(q.dtype))
        send = torch.cat([q_lat, q[..., dn:]], -1)[self.order.to(x.device)]     # [T, H_local, R + Dr], by rank
        n = self.counts[self.rank]
        got = self._all_to_all(mixer, send, [n] * world, self.counts)           # [W * T_mine, H_local, R + Dr]
        width = send.shape[-1]
        q_all = got.view(world, n, hl, width).transpose(0, 1).reshape(n, world * hl, width)   # [T_mine, H, R + Dr]
        if n:
            meta = self.meta_mine
            topk = None
            if mixer.indexer is not None:
                topk = mixer.indexer(x[mine], c_q[mine], meta, cache.index_keys[mixer.mla_index], pages[mine],
                                     offsets[mine], keys_written=True)
            eye = torch.eye(r, dtype=q.dtype, device=x.device).expand(world * hl, r, r)
            decode = meta.mode is ForwardMode.DECODE
            kv_pages, kv_scale, table = readable_latents(k, view, meta.block_table, x.dtype)
            o_lat = k.mla.decode(q_all[..., :r].contiguous(), q_all[..., r:].contiguous(), kv_pages,
                                 table, meta.seq_lens, eye, eye, scale=cfg.mla_softmax_scale,
                                 cu_seqlens_q=None if decode else meta.cu_seqlens, kv_cache_scale=kv_scale,
                                 topk_indices=topk)                             # [T_mine, H, R]
        else:
            o_lat = q_all[..., :r]
        back = o_lat.reshape(n, world, hl, r).transpose(0, 1).reshape(world * n, hl, r)
        got = self._all_to_all(mixer, back, self.counts, [n] * world)           # [T, H_local, R], by rank
        o = torch.empty_like(got)
        o[self.order.to(x.device)] = got                                        # token order
        return torch.einsum("thr,hrv->thv", o, w_uv.to(o.dtype))                # [T, H_local, Dv]
