"""The checkpoint families k3 reads, as tables: renames onto k3's canonical names, and fused
tensors that hold several canonical tensors at once.

Canonical names are the model's own (`k3.checkpoint.names`). The families:

- k3 and Moonshot's published checkpoints: canonical names; K3 under `language_model.`.
- transformers' `save_pretrained` of Kimi-Linear with its default `save_original_format=True`:
  the published names (it reverses its conversion mapping), except that a dense layer's MLP is
  written under `block_sparse_moe.` (renamed back by `names.canonical_name`).
- transformers' runtime names (`save_pretrained(save_original_format=False)`, or a state dict of
  the model): the forget gate's tensors under `self_attn.forget_gate.`, the MoE block under
  `mlp.`, the three short-conv weights fused into `self_attn.conv1d.weight` [3P, 1, W] (q, k, v
  rows), and the routed experts stacked: `mlp.experts.gate_up_proj` [E, 2I, d] (each expert's
  gate rows then up rows: its w1 then w3) and `mlp.experts.down_proj` [E, d, I] (w2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Rename:
    """Names matching `pattern` are rewritten to `replacement` (re.sub)."""

    family: str
    pattern: re.Pattern
    replacement: str


@dataclass(frozen=True)
class FusedTensor:
    """A checkpoint tensor `<module>.<name>` holding the canonical tensors `<module>.<part>`.

    Without experts, the parts are concatenated along dim 0, in order. With `experts`, dim 0
    indexes the expert and each expert's slice is the concatenation along its dim 0 of the
    parts, whose names hold "{expert}"."""

    family: str
    name: str
    parts: tuple[str, ...]
    experts: bool = False

    @property
    def pattern(self) -> re.Pattern:
        return re.compile(rf"^(?P<module>model\.layers\.\d+\.)(?P<name>{re.escape(self.name)})$")


TRANSFORMERS_RUNTIME = "transformers Kimi-Linear (runtime names)"

RENAMES: tuple[Rename, ...] = (
    Rename(TRANSFORMERS_RUNTIME, re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
    Rename(TRANSFORMERS_RUNTIME, re.compile(r"\.mlp\.(gate|shared_experts|experts)\."), r".block_sparse_moe.\1."),
)

FUSED: tuple[FusedTensor, ...] = (
    FusedTensor(TRANSFORMERS_RUNTIME, "self_attn.conv1d.weight",
                ("self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight")),
    FusedTensor(TRANSFORMERS_RUNTIME, "block_sparse_moe.experts.gate_up_proj",
                ("block_sparse_moe.experts.{expert}.w1.weight", "block_sparse_moe.experts.{expert}.w3.weight"),
                experts=True),
    FusedTensor(TRANSFORMERS_RUNTIME, "block_sparse_moe.experts.down_proj",
                ("block_sparse_moe.experts.{expert}.w2.weight",), experts=True),
)


def apply_renames(name: str) -> str:
    """`name` with every family's renames applied (the families' names do not collide)."""
    for rule in RENAMES:
        name = rule.pattern.sub(rule.replacement, name)
    return name


@dataclass(frozen=True)
class Unfused:
    """A fused checkpoint tensor matched by `rule`: the canonical templates of its parts."""

    rule: FusedTensor
    templates: tuple[str, ...]


def match_fused(name: str) -> Unfused | None:
    """The fused-tensor rule `name` (already renamed) matches, with its parts' templates."""
    for rule in FUSED:
        m = rule.pattern.match(name)
        if m:
            return Unfused(rule, tuple(m.group("module") + part for part in rule.parts))
    return None
