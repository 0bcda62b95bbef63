"""Parameter counts of a config, from the same WeightSpecs the loader reads (meta device).

Counts are logical parameters: an MXFP4 byte holds two, quantisation scales are not
parameters. Active parameters are those one token's forward touches: its embedding row,
lm_head, every non-expert weight, the shared experts and top-k routed experts per MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.config import K3Config


@dataclass(frozen=True)
class ParameterCount:
    total: int
    active: int
    embedding: int
    routed_experts: int
    per_routed_expert: dict[int, int]   # MoE layer -> logical parameters of one routed expert


def count_parameters(cfg: K3Config) -> ParameterCount:
    from .model import K3ForCausalLM

    model = K3ForCausalLM(cfg, dtype=torch.bfloat16, device="meta")
    total = routed = embedding = 0
    per_expert: dict[int, int] = {}
    for template, _, spec in model.weight_specs():
        n = spec.logical_numel
        total += n
        if spec.stack:
            routed += n
            layer = int(template.split(".")[2])
            per_expert[layer] = per_expert.get(layer, 0) + n // spec.stack[0]
        elif template == "model.embed_tokens.weight":
            embedding = n
    inactive_experts = sum((cfg.num_experts - cfg.num_experts_per_token) * n for n in per_expert.values())
    inactive_embedding = embedding - cfg.hidden_size        # one embedding row per token
    return ParameterCount(total=total, active=total - inactive_experts - inactive_embedding,
                          embedding=embedding, routed_experts=routed, per_routed_expert=per_expert)
