"""Checkpoint tensor names: from the names published checkpoints use to k3's canonical names.

Canonical names are the model's own (`model.layers.L.self_attn.q_proj.weight`,
`lm_head.weight`, experts as `...experts.{expert}.w1.weight_packed`). Published K3
checkpoints prefix the text model with `language_model.` (and some tools write
`language_model.layers.` without `model.`); transformers' `save_pretrained` of Kimi-Linear
writes a dense layer's MLP under `block_sparse_moe.{gate,up,down}_proj`, and its runtime names
are renamed or unfused as `k3.checkpoint.families` tabulates. Vision weights, rotary caches and
MTP layers (index >= num_hidden_layers) are skipped; with part="mtp" it is the other way round:
only the MTP layers map (their AttnRes weights skipped: the MTP block has none), the text model
is skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from k3.config import K3Config

from .families import Unfused, apply_renames, match_fused

_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
K3_PREFIX = "language_model."


@dataclass(frozen=True)
class CanonicalName:
    """A checkpoint tensor name mapped onto the model: template (experts as "{expert}"),
    the expert number when it is one of a stack, or `skip_reason` for tensors k3 ignores;
    `fused` when the tensor holds several canonical tensors (template is then its renamed name)."""

    template: str
    expert: int | None = None
    skip_reason: str | None = None
    fused: Unfused | None = None


_ATTN_RES = re.compile(r"\.(self_attention_res|mlp_res)_(norm|proj)\.")
PARTS = ("text", "mtp")


def canonical_name(name: str, cfg: K3Config, part: str = "text") -> CanonicalName:
    """Map one checkpoint tensor name (see the module docstring); part "text" (the text
    model) or "mtp" (its MTP layers, `k3.model.mtp`)."""
    if part not in PARTS:
        raise ValueError(f"unknown checkpoint part {part!r}; known: {', '.join(PARTS)}")
    if name.startswith(SKIPPED_PREFIXES):
        return CanonicalName(name, skip_reason="vision")
    if name.startswith(K3_PREFIX):
        name = name[len(K3_PREFIX):]
        if name.startswith("layers.") or name in ("embed_tokens.weight", "norm.weight"):
            name = "model." + name
    if "rotary_emb." in name:
        return CanonicalName(name, skip_reason="rotary cache")
    name = apply_renames(name)
    layer = _LAYER.match(name)
    index = int(layer.group(1)) if layer else None
    is_mtp = index is not None and index >= cfg.num_hidden_layers
    if part == "text" and is_mtp:
        return CanonicalName(name, skip_reason="MTP layer")
    if part == "mtp":
        if not is_mtp:
            return CanonicalName(name, skip_reason="text model")
        if _ATTN_RES.search(name):
            return CanonicalName(name, skip_reason="MTP AttnRes weight (the MTP block has no AttnRes)")
    if layer:
        if not cfg.is_moe_layer(index):   # transformers' save_pretrained of a dense Kimi-Linear layer
            name = re.sub(r"\.block_sparse_moe\.(gate|up|down)_proj\.", r".mlp.\1_proj.", name)
    fused = match_fused(name)
    if fused:
        return CanonicalName(name, fused=fused)
    expert = _EXPERT.search(name)
    if expert:
        return CanonicalName(_EXPERT.sub(".experts.{expert}.", name, count=1), int(expert.group(1)))
    return CanonicalName(name)


def published_name(template: str, cfg: K3Config, expert: int | None = None) -> str:
    """The name a checkpoint of this model family uses for a canonical template."""
    name = template.replace("{expert}", str(expert)) if expert is not None else template
    return K3_PREFIX + name if cfg.model_type == "kimi_k3" else name
