"""A DSpark-style draft model (`model_type: k3_dspark`) for K3 targets.

Semi-autoregressive drafting (DeepSeek-AI x PKU's DSpark, as vLLM's K3 DSpark draft wires it):
- context features: the target's hidden states tapped after `target_layer_ids`, concatenated,
  projected and RMS-normed (`context_proj`, `context_norm`), written once per target token as
  every draft layer's MLA latent `[kv_a_layernorm(c) | rope(k_pe)]` at that token's position;
- a query block: the anchor token (the last sampled one) and `block_size - 1` mask tokens at
  consecutive positions, one parallel forward through dense MLA layers WITH RoPE (interleaved
  pairs, theta `rope_theta`), non-causal inside the block, full over the context; the final norm
  and the target's shared lm_head give base logits U_k;
- a Markov head sampled left to right: logits_k = U_k + w2 . w1[x_{k-1}] (rank `markov_rank`).
Embedding and lm_head are the target's (shared); the draft runs replicated (tensor parallel
size 1 only).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from k3 import reference as ref

from .module import K3Module


@dataclass(frozen=True)
class DSparkConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    vocab_size: int
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    markov_rank: int
    hidden_act: str = "silu"
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 50000.0
    dtype: str = "bfloat16"

    @classmethod
    def from_dict(cls, raw: dict) -> "DSparkConfig":
        if raw.get("model_type") != "k3_dspark":
            raise ValueError(f"a DSpark draft config has model_type 'k3_dspark', got {raw.get('model_type')!r}")
        fields = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in fields]
        if missing:
            raise ValueError(f"DSpark config field {missing[0]!r} is required")
        fields["target_layer_ids"] = tuple(fields["target_layer_ids"])
        return cls(**fields)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "DSparkConfig":
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))

    def to_dict(self) -> dict:
        out = {"model_type": "k3_dspark", **{f: getattr(self, f) for f in self.__dataclass_fields__}}
        out["target_layer_ids"] = list(self.target_layer_ids)
        return out


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on interleaved pairs (x0, x1), (x2, x3), ... of the last axis.
    x [T, ..., D]; positions [T]."""
    d = x.shape[-1]
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    freqs = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=cd) / d)           # [D/2]
    angles = positions.to(cd)[:, None] * freqs[None, :]                                # [T, D/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    pairs = x.to(cd).unflatten(-1, (d // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2).to(x.dtype)


class DSparkLayer(K3Module):
    def __init__(self, cfg: DSparkConfig, *, dtype, device=None):
        super().__init__()
        self.cfg = cfg
        d, h = cfg.hidden_size, cfg.num_attention_heads
        dqk, r = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank
        for name, shape in (("input_layernorm", (d,)), ("post_attention_layernorm", (d,))):
            self.add_weight(name, shape, dtype, device)
        weights = {"q_a_proj": (cfg.q_lora_rank, d), "q_a_layernorm": (cfg.q_lora_rank,),
                   "q_b_proj": (h * dqk, cfg.q_lora_rank), "kv_a_proj_with_mqa": (r + cfg.qk_rope_head_dim, d),
                   "kv_a_layernorm": (r,), "kv_b_proj": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), r),
                   "o_proj": (d, h * cfg.v_head_dim)}
        for name, shape in weights.items():
            self.add_weight(name, shape, dtype, device, checkpoint=f"self_attn.{name}.weight")
        i = cfg.intermediate_size
        self.add_fused_weight("gate_up_proj", [(f"mlp.{part}.weight", (i, d), None)
                                               for part in ("gate_proj", "up_proj")], dtype, device)
        self.add_weight("down_proj", (d, i), dtype, device, checkpoint="mlp.down_proj.weight")

    def latent_rows(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T, R + Dr]: the cached MLA row of each input (normed latent | roped k_pe)."""
        cfg, r = self.cfg, self.cfg.kv_lora_rank
        kv = F.linear(hidden, self.kv_a_proj_with_mqa)
        return torch.cat([ref.rms_norm(kv[:, :r], self.kv_a_layernorm, cfg.rms_norm_eps),
                          rope(kv[:, r:], positions, cfg.rope_theta)], -1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """One query block of one sequence: x [B, d] at `positions`; context [S, R + Dr] the
        context rows. Non-causal inside the block, full over the context."""
        cfg = self.cfg
        h, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                            cfg.kv_lora_rank)
        eps = cfg.rms_norm_eps
        hidden = ref.rms_norm(x, self.input_layernorm, eps)
        q = F.linear(ref.rms_norm(F.linear(hidden, self.q_a_proj), self.q_a_layernorm, eps), self.q_b_proj)
        q = q.view(-1, h, dn + dr)
        q = torch.cat([q[..., :dn], rope(q[..., dn:], positions, cfg.rope_theta)], -1)
        rows = torch.cat([context.to(x.dtype), self.latent_rows(hidden, positions)])            # [S + B, R + Dr]
        k, v = ref.mla_expand_kv(rows[:, :r], rows[:, r:], self.kv_b_proj, num_heads=h, qk_nope_head_dim=dn,
                                 v_head_dim=dv)
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        scores = torch.einsum("bhd,shd->hbs", q.to(cd), k.to(cd)) * (dn + dr) ** -0.5
        o = torch.einsum("hbs,shd->bhd", torch.softmax(scores, -1), v.to(cd)).to(x.dtype).reshape(-1, h * dv)
        x = x + F.linear(o, self.o_proj)
        a = ref.glu_activation(F.linear(ref.rms_norm(x, self.post_attention_layernorm, eps), self.gate_up_proj),
                               activation=cfg.hidden_act, beta=cfg.activation_situ_beta,
                               linear_beta=cfg.activation_situ_linear_beta)
        return x + F.linear(a, self.down_proj)


class DSparkDraft(K3Module):
    """The draft's own weights; `embed` and `lm_head` are the target's (passed in)."""

    def __init__(self, cfg: DSparkConfig, *, dtype, device=None):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        d = cfg.hidden_size
        self.add_weight("context_proj", (d, len(cfg.target_layer_ids) * cfg.target_hidden_size), dtype, device)
        self.add_weight("context_norm", (d,), dtype, device)
        self.layers = torch.nn.ModuleList(DSparkLayer(cfg, dtype=dtype, device=device)
                                          for _ in range(cfg.num_hidden_layers))
        self.add_weight("final_norm", (d,), dtype, device)
        self.add_weight("markov_w1", (cfg.vocab_size, cfg.markov_rank), dtype, device,
                        checkpoint="markov_head.w1.weight")
        self.add_weight("markov_w2", (cfg.vocab_size, cfg.markov_rank), dtype, device,
                        checkpoint="markov_head.w2.weight")

    def context_rows(self, taps: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Per draft layer [T, R + Dr]: the rows the target tokens' tapped features give."""
        c = ref.rms_norm(F.linear(taps.to(self.dtype), self.context_proj), self.context_norm, self.cfg.rms_norm_eps)
        return [layer.latent_rows(c, positions) for layer in self.layers]

    @torch.no_grad()
    def base_logits(self, anchor: int, position: int, context: list[torch.Tensor], embed, lm_head) -> torch.Tensor:
        """U [block_size, V]: the query block after `context` (per layer [S, R + Dr])."""
        cfg = self.cfg
        ids = torch.tensor([anchor] + [cfg.mask_token_id] * (cfg.block_size - 1), device=context[0].device)
        positions = torch.arange(position, position + cfg.block_size, device=ids.device)
        x = embed(ids).to(self.dtype)
        for layer, ctx in zip(self.layers, context):
            x = layer(x, positions, ctx)
        return lm_head(ref.rms_norm(x, self.final_norm, cfg.rms_norm_eps))

    def markov_bias(self, previous: int) -> torch.Tensor:
        """[V]: the Markov head's correction given the previous token."""
        return F.linear(self.markov_w1[previous], self.markov_w2)
