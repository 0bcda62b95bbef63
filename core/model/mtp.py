"""The MTP (multi-token prediction) draft layer of a K3-architecture checkpoint.

Checkpoints with `num_nextn_predict_layers = n > 0` carry n MTP layers at indices
`num_hidden_layers .. num_hidden_layers + n - 1` (vLLM's `KimiK3MTP`; the released K3 has none,
k3-architecture.md 2.9). MTP layer L maps (the next token t_{p+1}, the target's pre-norm final
hidden state h_p at position p) to a prediction of t_{p+2}:

    e = RMS_enorm(embed(t_{p+1})), zero at position 0
    x = eh_proj([e | RMS_hnorm(h_p)])                 # [T, 2d] -> [T, d], bias-free
    x = x + MLA_L(RMS_input_layernorm(x))             # the K3 MLA of layer L (gated, NoPE, DSA
    x = x + FFN_L(RMS_post_attention_layernorm(x))    #   when the model has it), its own cache
    logits = shared_head.head(RMS_shared_head.norm(x))   # no logit_scale, as vLLM's MTP head

The block is an ordinary K3 decoder layer with AttnRes off (plain pre-norm residual), so it
runs on the platform's kernels like every target layer. x is also the pre-norm state a chained
draft step feeds back as h. Checkpoint names: `model.layers.L.{enorm,hnorm,eh_proj,shared_head.*}`
and the block's usual `model.layers.L.self_attn.*`, `.block_sparse_moe.*` / `.mlp.*`, norms; an
`embed_tokens` or `shared_head.head` of the layer's own is optional (absent: the target's).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from k3.config import K3Config
from k3.model.metadata import CacheViews, ForwardMetadata
from k3.plugin.tables import KernelSet

from .decoder import DecoderLayer
from .module import K3Module
from .parallel import ParallelContext

OWN_EMBED = "embed_tokens.weight"
OWN_HEAD = "shared_head.head.weight"


def mtp_block_config(cfg: K3Config) -> K3Config:
    """The decoder-layer config of an MTP block: the target's, AttnRes off."""
    return dataclasses.replace(cfg, attn_res_block_size=None)


def mtp_cache_config(cfg: K3Config, num_layers: int = 1) -> K3Config:
    """A config whose cache holds `num_layers` MLA layers of the target's geometry (and its DSA
    index keys) and no KDA state: the MTP layers' own attention cache."""
    return dataclasses.replace(cfg, num_hidden_layers=num_layers, linear_attn=None, attn_res_block_size=None)


class MTPLayer(K3Module):
    """MTP layer `index` (0-based among the MTP layers) of `cfg`, for one rank. Its checkpoint
    templates are `model.layers.{cfg.num_hidden_layers + index}.*` (`weight_specs`).

    own_embed / own_head: the checkpoint carries the layer's own `embed_tokens` / `shared_head.head`
    (else `forward` uses the embedding and lm_head it is given: the target's)."""

    def __init__(self, cfg: K3Config, index: int = 0, *, kernels: KernelSet, parallel: ParallelContext,
                 dtype: torch.dtype, device=None, own_embed: bool = False, own_head: bool = False):
        super().__init__()
        if parallel.world_size != 1:
            raise ValueError("the MTP layer runs with tensor parallel size 1 only")
        self.cfg, self.dtype, self.kernels = cfg, dtype, kernels
        self.layer_index = cfg.num_hidden_layers + index
        d = cfg.hidden_size
        for name in ("enorm", "hnorm"):
            self.add_weight(name, (d,), dtype, device, dims=("hidden_size",))
        self.add_weight("eh_proj", (d, 2 * d), dtype, device, dims=("hidden_size", "2 * hidden_size"))
        self.add_weight("shared_head_norm", (d,), dtype, device, checkpoint="shared_head.norm.weight",
                        dims=("hidden_size",))
        self.own_embed, self.own_head = own_embed, own_head
        if own_embed:
            self.add_weight("embed_tokens", (cfg.vocab_size, d), dtype, device, dims=("vocab_size", "hidden_size"))
        if own_head:
            self.add_weight("shared_head_head", (cfg.vocab_size, d), dtype, device, checkpoint=OWN_HEAD,
                            dims=("vocab_size", "hidden_size"))
        # mla_index 0: the MTP cache (`mtp_cache_config`) holds this layer's latents as its layer 0
        self.block = DecoderLayer(mtp_block_config(cfg), self.layer_index, kda_index=None, mla_index=0,
                                  kernels=kernels, parallel=parallel, dtype=dtype, device=device)

    def weight_specs(self, prefix: str = ""):
        """Checkpoint templates under `model.layers.L.` (the block's without a `block.` level);
        parameter names relative to this module."""
        layer = f"model.layers.{self.layer_index}."
        for spec in self._weight_specs:
            yield layer + spec.checkpoint_name, prefix + spec.param, spec
        for template, param, spec in self.block.weight_specs():
            yield layer + template, f"{prefix}block.{param}", spec

    def forward(self, next_ids: torch.Tensor, previous_hidden: torch.Tensor, meta: ForwardMetadata,
                cache: CacheViews, *, embed, decode: bool = False) -> torch.Tensor:
        """next_ids [T] the token after each position, previous_hidden [T, d] the pre-norm state
        at that position (the target's, or this layer's own for a chained step), meta: the
        positions in the MTP cache (latents written at meta.slot_mapping). embed(ids) -> [T, d]:
        the target's embedding (ignored with own_embed). Returns x [T, d], the pre-norm output."""
        cfg, norm, eps = self.cfg, self.kernels.elementwise.rms_norm, self.cfg.rms_norm_eps
        e = F.embedding(next_ids, self.embed_tokens) if self.own_embed else embed(next_ids)
        e = e.to(self.dtype).masked_fill((meta.positions == 0)[:, None], 0)
        x = F.linear(torch.cat([norm(e, self.enorm, eps), norm(previous_hidden.to(self.dtype), self.hnorm, eps)], -1),
                     self.eh_proj)
        block = self.block
        x = (x + block.self_attn(norm(x, block.input_layernorm, eps), meta, cache)).to(self.dtype)
        return (x + block.ffn(norm(x, block.post_attention_layernorm, eps), decode=decode)).to(self.dtype)

    def logits(self, x: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """x [M, d] pre-norm -> [M, V] fp32 (fp64 for a float64 model); lm_head: the target's
        weight (ignored with own_head)."""
        head = self.shared_head_head if self.own_head else lm_head
        out = torch.float64 if self.dtype == torch.float64 else torch.float32
        normed = self.kernels.elementwise.rms_norm(x, self.shared_head_norm, self.cfg.rms_norm_eps)
        return F.linear(normed, head).to(out)
