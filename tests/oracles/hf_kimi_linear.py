"""HF transformers' own Kimi-Linear model (`transformers.models.kimi_linear`, its pure-torch path
without fla) as an oracle for k3's graph: checkpoints written by transformers, logits computed by
transformers.

Each shape is a `KimiLinearConfig`; the weights are transformers' own random init
(`_init_weights`, with `initializer_range` raised so logit margins suit token comparisons), from
a fixed seed, plus two changes of values, not of mechanism: every RMSNorm weight is drawn
around 1 (transformers inits them to exactly 1, which would hide a norm loaded into the wrong
place) and the router's `e_score_correction_bias` is drawn non-zero (it inits it to 0, which
would hide a bias used for more than the selection). `save_pretrained` writes the checkpoint
(by default transformers' published names; `runtime_names` writes its internal layout).

Where transformers' Kimi-Linear and k3 differ (transformers 5.19):
- MLA `q_a_layernorm` / `kv_a_layernorm` eps: KimiLinearRMSNorm's default 1e-6 in transformers,
  rms_norm_eps in k3 (as vLLM). Patched for the exact comparison (`mla_norm_eps`); the tests
  measure it unpatched (a few 1e-5 of the largest logit on these shapes).
- Precision: transformers computes its RMSNorms (input and gated), the KDA gate, q/k L2 norms
  and recurrence, and the router in float32 even in a float64 model; k3's float64 model
  computes them in float64. Rounding only (~1e-5 on the log-probabilities here).
- Short-conv activation: transformers applies `hidden_act`, k3 (as vLLM) always SiLU; the same
  for Kimi-Linear (silu), and transformers cannot build another activation k3 accepts (situ).
- Softplus of the KDA gate: transformers log(1 + exp(x)) below 20, k3 torch's softplus (log1p)
  with threshold 20: equal up to rounding.
- Config defaults where a config.json says nothing (transformers always writes these fields):
  with no `mlp_layer_types` and no `first_k_dense_replace` transformers makes layer 0 dense, k3
  none; with no `layer_types` and no `linear_attn_config` transformers puts full attention at
  every 4th layer, k3 makes every layer MLA. transformers lets `layer_types` override
  `linear_attn_config`'s lists; k3 requires them to agree.
- Not built by k3: `attention_bias` (refused by K3Config), `num_key_value_heads` other than the
  head count (transformers itself then fails), a norm or projection bias anywhere.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

VOCAB = 320
BASE = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=None, initializer_range=0.1,
            rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, num_key_value_heads=None)


def _types(layers: int, mla: list[int]) -> list[str]:
    """transformers' layer_types from 1-based MLA layer numbers."""
    return ["full_attention" if i + 1 in mla else "linear_attention" for i in range(layers)]


# name -> (KimiLinearConfig arguments, save_pretrained's save_original_format)
SHAPES: dict[str, tuple[dict, bool]] = {
    # core/presets.py kimi_linear_tiny
    "kimi-linear-tiny": (dict(hidden_size=64, num_hidden_layers=6, layer_types=_types(6, [4, 6]),
                              num_attention_heads=4, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
                              q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                              intermediate_size=128, moe_intermediate_size=32, num_local_experts=8,
                              num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.446,
                              n_group=1, topk_group=1, first_k_dense_replace=1), True),
    # head_dim 32 with 3 heads, a query LoRA (q_a_proj), grouped top-k (4 groups, 2 kept), all
    # layers MoE, 5 layers, two shared experts, a short conv of 3
    "head32-qlora-grouped": (dict(hidden_size=48, num_hidden_layers=5, layer_types=_types(5, [3, 5]),
                                  num_attention_heads=3, linear_num_heads=3, linear_head_dim=32,
                                  linear_conv_kernel_dim=3, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
                                  qk_rope_head_dim=8, v_head_dim=12, intermediate_size=96, moe_intermediate_size=24,
                                  num_local_experts=16, num_experts_per_tok=3, n_shared_experts=2,
                                  routed_scaling_factor=1.5, n_group=4, topk_group=2, first_k_dense_replace=0),
                             True),
    # head_dim 64 with 2 heads, MLA first and last, two dense layers, 7 layers, grouped top-k
    # (2 groups, 1 kept); saved in transformers' runtime layout (fused conv1d, stacked experts)
    "head64-dense2-runtime": (dict(hidden_size=80, num_hidden_layers=7, layer_types=_types(7, [1, 7]),
                                   num_attention_heads=2, linear_num_heads=2, linear_head_dim=64,
                                   linear_conv_kernel_dim=4, q_lora_rank=20, kv_lora_rank=24, qk_nope_head_dim=24,
                                   qk_rope_head_dim=16, v_head_dim=32, intermediate_size=112, moe_intermediate_size=40,
                                   num_local_experts=6, num_experts_per_tok=2, n_shared_experts=1,
                                   routed_scaling_factor=2.446, n_group=2, topk_group=1, first_k_dense_replace=2),
                              False),
}


def build_model(name: str, *, seed: int = 0):
    """The transformers model of shape `name` (float32, as transformers inits it) with the
    value changes of the module docstring."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    config = KimiLinearConfig(**{**BASE, **SHAPES[name][0]})
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if "RMSNorm" in type(module).__name__:                     # norms, gated o_norm included
                module.weight.copy_(1 + 0.2 * torch.randn(module.weight.shape, generator=g))
            if type(module).__name__ == "KimiLinearTopkRouter":
                module.e_score_correction_bias.copy_(0.05 * torch.randn(module.e_score_correction_bias.shape,
                                                                        generator=g))
    return model


def write_checkpoint(name: str, out_dir: Path, *, seed: int = 0):
    """Save shape `name` with transformers' save_pretrained; returns the model in float64 (its
    experts on the eager path: the default grouped_mm takes no float64)."""
    model = build_model(name, seed=seed)
    model.save_pretrained(out_dir, save_original_format=SHAPES[name][1])
    model = model.to(torch.float64)
    model.set_experts_implementation("eager")
    return model


@contextlib.contextmanager
def mla_norm_eps(model, eps: float | None):
    """Within the block, transformers' MLA q_a_layernorm / kv_a_layernorm use `eps` (None: leave
    transformers' 1e-6); k3 uses the config's rms_norm_eps there."""
    norms = [m for layer in model.model.layers for m in (getattr(layer.self_attn, "q_a_layernorm", None),
                                                         getattr(layer.self_attn, "kv_a_layernorm", None))
             if m is not None]
    before = [m.variance_epsilon for m in norms]
    try:
        if eps is not None:
            for m in norms:
                m.variance_epsilon = eps
        yield len(norms)
    finally:
        for m, value in zip(norms, before):
            m.variance_epsilon = value


@torch.no_grad()
def forward_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits [T, V] (float64) of one sequence, all positions in one forward."""
    return model(torch.tensor([ids]), use_cache=False).logits[0]


@torch.no_grad()
def generate(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation through its cache (prefill, then its single-token decode
    path: causal_conv1d_update and the recurrent KDA): (tokens, step logits [n, V])."""
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits).to(torch.float64)


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """[T] top-1 minus top-2 logit of each row."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]
