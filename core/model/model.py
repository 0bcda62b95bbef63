"""The K3 model graph: embedding, decoder layers with Attention Residuals, final mix, lm_head.

K3 / K3.1 Pro wire the layers with Block AttnRes (k3-architecture.md 2.1-2.3): per layer an
AttnRes mix + input_layernorm before the mixer and another + post_attention_layernorm before
the FFN, the block bank written every `attn_res_block_size` layers, and a final mix (no norm)
that gives the pre-norm hidden state. Kimi-Linear uses the plain pre-norm residual stream.
logits = lm_head(RMSNorm(hidden)) * logit_scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from k3 import reference as ref
from k3.config import K3Config
from k3.model.metadata import CacheViews, ForwardMetadata
from k3.plugin.tables import KernelSet
from k3.platforms.torch_kernels.tables import torch_tables

from .decoder import DecoderLayer
from .mla import MLAMixer
from .module import K3Module
from .parallel import ParallelContext


# A `tap_layers` entry for the pre-norm final hidden state (what an MTP layer reads), beside
# layer numbers: taps[FINAL_HIDDEN] is `hidden_states`.
FINAL_HIDDEN = -1


@dataclass
class ForwardOutput:
    """logits [M, V] fp32 (fp64 for a float64 model) at meta.logits_indices; hidden_states
    [T, d] the pre-norm final hidden state (draft-model features); taps {layer: [T, d]} the
    running partial-block sum after that layer's FFN (vLLM's auxiliary hidden state), and
    taps[FINAL_HIDDEN] = hidden_states when asked for;
    kda_states {layer: [T, H_local, K, V]} the state after every token (speculative verify)."""

    logits: torch.Tensor
    hidden_states: torch.Tensor
    taps: dict[int, torch.Tensor] = field(default_factory=dict)
    kda_states: dict[int, torch.Tensor] = field(default_factory=dict)


class K3Model(K3Module):
    """Embedding, layers and the final AttnRes mix / norm (checkpoint prefix `model.`)."""

    def __init__(self, cfg: K3Config, *, kernels: KernelSet, parallel: ParallelContext, dtype: torch.dtype,
                 device=None):
        super().__init__()
        self.cfg, self.kernels, self.parallel = cfg, kernels, parallel
        d = cfg.hidden_size
        self.vocab_start, vocab_local = parallel.shard(cfg.vocab_size, "vocab_size")
        self.add_weight("embed_tokens", (vocab_local, d), dtype, device, full_shape=(cfg.vocab_size, d),
                        shard=(0, self.vocab_start, vocab_local), dims=("vocab_size", "hidden_size"))
        kda_ids, mla_ids = cfg.kda_layer_ids, cfg.mla_layer_ids
        self.layers = torch.nn.ModuleList(
            DecoderLayer(cfg, i, kda_index=kda_ids.index(i) if i in kda_ids else None,
                         mla_index=mla_ids.index(i) if i in mla_ids else None,
                         kernels=kernels, parallel=parallel, dtype=dtype, device=device)
            for i in range(cfg.num_hidden_layers))
        self.add_weight("norm", (d,), dtype, device, dims=("hidden_size",))
        if cfg.uses_attn_res:
            self.add_weight("output_attn_res_norm", (d,), dtype, device, dims=("hidden_size",))
            self.add_weight("output_attn_res_proj", (1, d), dtype, device, dims=("1", "hidden_size"))
        self._folded_queries: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def fold_weights(self) -> None:
        """Fold every AttnRes mix's logit weight u = norm.weight * proj.weight once
        (`k3.reference.fold_attn_res_query`) instead of in every forward: 25 launches of a k3-slice
        decode step and as many nodes of each decode graph; and split every MLA layer's kv_b_proj
        into its absorbed decode weights (`MLAMixer.fold_weights`). Call once the weights are final
        (the engine does, after loading and the platform's weight processing; call again after
        changing them). A model never folded folds on the fly, with the same values."""
        for module in self._mla_layers():
            module.fold_weights()
        self._folded_queries = {id(norm): (norm, proj, ref.fold_attn_res_query(norm, proj))
                                for norm, proj in self._attn_res_pairs()}

    def folded_weight_bytes(self) -> int:
        """Bytes `fold_weights` adds beside the parameters (works on a meta-device model): every
        MLA layer's absorbed w_uk and w_uv (as many elements as its kv_b_proj) and one AttnRes
        logit weight per mix (as many elements as its norm). The capacity plan counts them."""
        return (sum(m.kv_b_proj.numel() * m.kv_b_proj.element_size() for m in self._mla_layers())
                + sum(norm.numel() * norm.element_size() for norm, _ in self._attn_res_pairs()))

    def _mla_layers(self) -> list[MLAMixer]:
        return [m for m in self.modules() if isinstance(m, MLAMixer)]

    def _attn_res_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(norm weight, proj weight) of every AttnRes mix: two a layer and the output mix."""
        if not self.cfg.uses_attn_res:
            return []
        pairs = [(layer.self_attention_res_norm, layer.self_attention_res_proj) for layer in self.layers]
        pairs += [(layer.mlp_res_norm, layer.mlp_res_proj) for layer in self.layers]
        pairs.append((self.output_attn_res_norm, self.output_attn_res_proj))
        return pairs

    def _attn_res_query(self, norm: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
        folded = self._folded_queries.get(id(norm))
        if folded is not None and folded[0] is norm and folded[1] is proj:
            return folded[2]
        return ref.fold_attn_res_query(norm, proj)

    def embed(self, input_ids: torch.Tensor, media_embeds: torch.Tensor | None,
              media_positions: torch.Tensor | None = None) -> torch.Tensor:
        """[T, d]; vocabulary-parallel lookup; media placeholders take `media_embeds` in order.

        media_positions: the rows of the batch that take `media_embeds` (an engine step: only the
        placeholders of its images, not a placeholder id a prompt holds as text or a model
        generated); None: every media placeholder token."""
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed_tokens.shape[0])
        x = F.embedding(local.clamp(0, self.embed_tokens.shape[0] - 1), self.embed_tokens)
        x = self.parallel.all_reduce(x.masked_fill(~mine[:, None], 0))
        if media_embeds is not None:
            placeholder = (input_ids == self.cfg.media_placeholder_token_id if media_positions is None
                           else media_positions)
            x = x.clone()
            x[placeholder] = media_embeds.to(x.dtype)
        return x

    def forward(self, meta: ForwardMetadata, cache: CacheViews, *, media_embeds=None, media_positions=None,
                tap_layers=(), per_position_kda_states: bool = False, ep_dispatch: str | None = None,
                ep_capacity: int | None = None, mixer=None) -> ForwardOutput:
        """mixer: a stand-in for the layers' mixer calls, called as mixer(layer, h [T, d], meta,
        cache, per_position_kda_states, states) -> [T, d] (the token-sharded prefill runs the
        token-wise parts here and its own KDA / MLA calls); None: each layer's own mixer."""
        x0 = self.embed(meta.input_ids, media_embeds, media_positions)
        run = self._attn_res_layers if self.cfg.uses_attn_res else self._residual_layers
        # decode: the MoE's dispatch without host synchronisation (not in the batch-invariant mode,
        # whose decodes run as its prefills do)
        ffn = {"decode": meta.max_q_len == 1 and not self.kernels.batch_invariant, "ep_dispatch": ep_dispatch,
               "ep_capacity": ep_capacity,
               "lora": meta.lora}
        hidden, taps, states = run(x0, meta, cache, set(tap_layers), per_position_kda_states, ffn,
                                   mixer or self._mixer)
        if FINAL_HIDDEN in tap_layers:
            taps[FINAL_HIDDEN] = hidden
        return ForwardOutput(logits=torch.empty(0), hidden_states=hidden, taps=taps, kda_states=states)

    def _mixer(self, layer, h, meta, cache, per_position, states):
        if layer.is_kda:
            a, s = layer.self_attn(h, meta, cache, per_position_states=per_position)
            if s is not None:
                states[layer.layer] = s
            return a
        return layer.self_attn(h, meta, cache)

    def _attn_res_layers(self, x0, meta, cache, tap_layers, per_position, ffn, mixer):
        cfg, eps, attn_res = self.cfg, self.cfg.rms_norm_eps, self.kernels.attn_res
        block = cfg.attn_res_block_size
        bank = x0.new_empty(x0.shape[0], cfg.num_attn_res_blocks, x0.shape[1])   # [T, NB, d]
        prefix, delta, taps, states = x0, None, {}, {}
        for layer in self.layers:
            l, starts_block = layer.layer, layer.layer % block == 0
            visible = math.ceil(l / block)
            query = self._attn_res_query(layer.self_attention_res_norm, layer.self_attention_res_proj)
            step = attn_res.step(prefix, delta, bank, query=query, num_visible_blocks=visible,
                                 write_index=l // block if starts_block else None, eps=eps,
                                 out_norm_weight=layer.input_layernorm, out_eps=eps)
            prefix = step.prefix
            a = mixer(layer, step.h, meta, cache, per_position, states)
            prefix = a if starts_block else (prefix + a).to(x0.dtype)
            query = self._attn_res_query(layer.mlp_res_norm, layer.mlp_res_proj)
            step = attn_res.step(prefix, None, bank, query=query, num_visible_blocks=visible + starts_block,
                                 write_index=None, eps=eps, out_norm_weight=layer.post_attention_layernorm,
                                 out_eps=eps)
            prefix = step.prefix
            delta = layer.ffn(step.h, **ffn)
            if l in tap_layers:
                taps[l] = (prefix + delta).to(x0.dtype)
        prefix = (prefix + delta).to(x0.dtype)
        sources = torch.cat([bank.transpose(0, 1), prefix.unsqueeze(0)])          # [NB + 1, T, d]
        query = self._attn_res_query(self.output_attn_res_norm, self.output_attn_res_proj)
        return attn_res.mix(sources, query, eps=eps), taps, states

    def _fused_add_norm(self):
        """`elementwise.add_rms_norm` when a plugin backs it with a fused kernel; None when only the
        reference composition serves it, which the loop then runs with the served rms_norm (one
        kernel on GPUs) instead of the reference's."""
        if self.kernels.providers.get("elementwise.add_rms_norm", "reference") == "reference":
            return None
        return self.kernels.elementwise.add_rms_norm

    def _residual_layers(self, x0, meta, cache, tap_layers, per_position, ffn, mixer):
        eps, norm = self.cfg.rms_norm_eps, self.kernels.elementwise.rms_norm
        add_norm = self._fused_add_norm()
        residual, taps, states = x0, {}, {}
        for layer in self.layers:
            a = mixer(layer, norm(residual, layer.input_layernorm, eps), meta, cache, per_position, states)
            if add_norm is not None:
                h, residual = add_norm(a, residual, layer.post_attention_layernorm, eps)
            else:
                residual = (residual + a).to(x0.dtype)
                h = norm(residual, layer.post_attention_layernorm, eps)
            residual = (residual + layer.ffn(h, **ffn)).to(x0.dtype)
            if layer.layer in tap_layers:
                taps[layer.layer] = residual
        return residual, taps, states


class K3ForCausalLM(K3Module):
    """The text model of a K3-architecture checkpoint, for one tensor-parallel rank."""

    def __init__(self, cfg: K3Config, *, kernels: KernelSet | None = None, parallel: ParallelContext | None = None,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        """kernels: the platform's resolved kernels (`Platform.kernels`); None: the reference ops."""
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.kernels = kernels or reference_kernels()
        self.parallel = parallel or ParallelContext()
        self.model = K3Model(cfg, kernels=self.kernels, parallel=self.parallel, dtype=dtype, device=device)
        if not cfg.tie_word_embeddings:
            v0, vl = self.model.vocab_start, self.model.embed_tokens.shape[0]
            self.add_weight("lm_head", (vl, cfg.hidden_size), dtype, device,
                            full_shape=(cfg.vocab_size, cfg.hidden_size), shard=(0, v0, vl),
                            dims=("vocab_size", "hidden_size"))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, d] pre-norm hidden -> [M, V] logits in fp32 (fp64 for a float64 model)."""
        normed = self.kernels.elementwise.rms_norm(hidden, self.model.norm, self.cfg.rms_norm_eps)
        out_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        local = self.kernels.dense.linear(normed, self.lm_head_weight).to(out_dtype)
        return self.parallel.all_gather(local, dim=-1) * self.cfg.logit_scale

    @torch.no_grad()
    def forward(self, meta: ForwardMetadata, cache: CacheViews, *, media_embeds: torch.Tensor | None = None,
                media_positions: torch.Tensor | None = None, tap_layers=(), per_position_kda_states: bool = False,
                ep_dispatch: str | None = None, ep_capacity: int | None = None) -> ForwardOutput:
        """Run the new tokens of a batch, reading and updating `cache` (see ForwardMetadata).
        media_embeds / media_positions: image embedding rows and the batch rows they replace
        (`K3Model.embed`). ep_dispatch / ep_capacity: this step's expert-parallel dispatch ("all_to_all" or
        "all_to_all_static") and static capacity (the most tokens any EP rank runs this step),
        overriding `ExpertParallel.dispatch` / `.capacity`; the same on every EP rank. Ignored
        without an EP group."""
        out = self.model(meta, cache, media_embeds=media_embeds, media_positions=media_positions,
                         tap_layers=tap_layers,
                         per_position_kda_states=per_position_kda_states, ep_dispatch=ep_dispatch,
                         ep_capacity=ep_capacity)
        out.logits = self.compute_logits(out.hidden_states[meta.logits_indices])
        return out

    @torch.no_grad()
    def idle_forward(self, *, ep_dispatch: str | None = None, ep_capacity: int | None = None) -> None:
        """A step with no local tokens: only every MoE layer's expert-parallel collectives run,
        in layer order, with zero rows of this rank's own, so the other EP ranks' dispatch and
        combine complete (every rank of a data-parallel replica without work this step). No
        cache, metadata or dummy request is touched. Every EP rank must make the same MoE calls
        per step (one `forward` or one `idle_forward`) with the same ep_dispatch / ep_capacity
        (`forward`'s); for "all_to_all_static" the capacity is the step's all-reduced (max)
        token count, also here. A no-op without an EP group."""
        for layer in self.model.layers:
            if layer.is_moe:
                layer.block_sparse_moe.idle(ep_dispatch, ep_capacity)

    def commit_speculation(self, cache: CacheViews, slots: torch.Tensor, rows: torch.Tensor,
                           kept: torch.Tensor) -> None:
        """Rollback "recover": every KDA layer's running rows after `kept` verified tokens."""
        for layer in self.model.layers:
            if layer.is_kda:
                layer.self_attn.commit_records(cache, slots, rows, kept)


def reference_kernels() -> KernelSet:
    """The pure-torch kernel set as a KernelSet: what `Platform.kernels` resolves to on the
    reference platform (torch fast paths, else the reference ops)."""
    tables = torch_tables()
    providers = {f"{family}.{entry}": "reference" for family, table in tables.items() for entry in table.provided()}
    return KernelSet(**tables, providers=providers)
