"""LoRA adapter slots on the model graph: which weights take an adapter, where its tensors live,
and the hook the layers call after each adapted product.

A module declares the parameters it applies with a plain product (`LORA_PARAMS`); every
checkpoint tensor that fills one of them is a LoRA target named as the checkpoint names the
module ("model.layers.0.self_attn.q_proj", the routed experts with "{expert}"), the name PEFT
writes without its "base_model.model." prefix. A fused parameter (KDA's and MLA's `in_proj`, the
MLP's `gate_up_proj`, the experts' `w13`) has one target per part, each writing its rows of the
product. `attach_lora` gives the model `max_loras` slots of rank `max_rank`; a target's A
[S, R, in] and B [S, out, R] (routed experts: [S, E_local, ...]) are allocated on the first
adapter that uses it. The forward reads the slot of every row from `ForwardMetadata.lora`
(`k3.model.metadata.LoRAMetadata`); a row of slot -1 is the base model, bit for bit.
File loading and slot bookkeeping are `k3.lora` (a higher layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .metadata import LoRAMetadata
from .module import K3Module

__all__ = ["LoRATarget", "LoRAState", "attach_lora", "apply_lora", "lora_targets_of", "merged_weight"]


@dataclass
class LoRATarget:
    """One adapted block of a module's parameter.

    name: the target's module name ("model.layers.0.self_attn.q_proj"; experts
        "...experts.{expert}.w1"); param: the module's parameter it adds to; rows: the rows of
    that parameter's output it writes; in_features / out_features: its A and B dimensions;
    experts: E_local for a stacked expert weight (None otherwise); a, b: the slot stacks
    (None until an adapter uses the target)."""

    name: str
    module: K3Module = field(repr=False)
    param: str
    rows: slice
    in_features: int
    out_features: int
    experts: int | None = None
    a: torch.Tensor | None = field(default=None, repr=False)
    b: torch.Tensor | None = field(default=None, repr=False)


class LoRAState:
    """The model's adapter slots: targets by name, the per-slot scale, allocation and writes."""

    def __init__(self, targets: dict[str, LoRATarget], *, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device):
        self.targets, self.max_loras, self.max_rank = targets, max_loras, max_rank
        self.dtype, self.device = dtype, device
        self.scales = torch.zeros(max_loras, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                                  device=device)

    def _allocate(self, target: LoRATarget) -> None:
        lead = (self.max_loras,) if target.experts is None else (self.max_loras, target.experts)
        target.a = torch.zeros(*lead, self.max_rank, target.in_features, dtype=self.dtype, device=self.device)
        target.b = torch.zeros(*lead, target.out_features, self.max_rank, dtype=self.dtype, device=self.device)

    def write(self, slot: int, name: str, a: torch.Tensor, b: torch.Tensor, expert: int | None = None) -> None:
        """Slot `slot` of target `name` (expert `expert` of a stacked one) takes A [r, in] and
        B [out, r], r <= max_rank (zero-padded). Shapes are the caller's to check."""
        target = self.targets[name]
        if target.a is None:
            self._allocate(target)
        r = a.shape[0]
        at = target.a[slot] if expert is None else target.a[slot, expert]
        bt = target.b[slot] if expert is None else target.b[slot, expert]
        at.zero_()
        bt.zero_()
        at[:r] = a.to(self.dtype)
        bt[:, :r] = b.to(self.dtype)

    def set_scale(self, slot: int, scale: float) -> None:
        self.scales[slot] = scale

    def clear(self, slot: int) -> None:
        """Every target's slot `slot` back to zero (an unloaded adapter adds nothing)."""
        self.scales[slot] = 0
        for target in self.targets.values():
            if target.a is not None:
                target.a[slot].zero_()
                target.b[slot].zero_()


def lora_targets_of(model: K3Module) -> dict[str, LoRATarget]:
    """Every weight of `model` that can take an adapter, by target name (see the module docstring)."""
    targets: dict[str, LoRATarget] = {}
    for checkpoint, qualified, spec in model.weight_specs():
        module_name, param = qualified.rsplit(".", 1) if "." in qualified else ("", qualified)
        module = model.get_submodule(module_name)
        base = param[: -len("_packed")] if param.endswith("_packed") else param
        if base not in getattr(module, "LORA_PARAMS", ()) or spec.logical_per_element == 0:
            continue
        for suffix in (".weight_packed", ".weight"):
            if checkpoint.endswith(suffix):
                name = checkpoint[: -len(suffix)]
                break
        else:
            continue
        out_rows, in_cols = spec.local_shape[0], spec.local_shape[-1] * spec.logical_per_element
        rows = spec.dest[0] if spec.dest else slice(0, out_rows)
        targets[name] = LoRATarget(name, module, base, rows, in_cols, out_rows,
                                   experts=spec.stack[2] if spec.stack else None)
    return targets


def attach_lora(model: K3Module, *, max_loras: int, max_rank: int, dtype: torch.dtype, device) -> LoRAState:
    """Give `model` `max_loras` adapter slots of rank `max_rank` (adapter tensors in `dtype`):
    every module with an adapted parameter gets its targets (`_lora_targets`, by parameter)."""
    targets = lora_targets_of(model)
    for target in targets.values():
        per_param = target.module.__dict__.setdefault("_lora_targets", {})
        per_param.setdefault(target.param, []).append(target)
    state = LoRAState(targets, max_loras=max_loras, max_rank=max_rank, dtype=dtype, device=device)
    for target in targets.values():
        target.module.__dict__["_lora_scales"] = state.scales
    return state


def _live(module: K3Module, param: str, lora: LoRAMetadata | None) -> list[LoRATarget]:
    if lora is None:
        return []
    return [t for t in module.__dict__.get("_lora_targets", {}).get(param, ()) if t.a is not None]


def apply_lora(module: K3Module, param: str, x: torch.Tensor, y: torch.Tensor,
               lora: LoRAMetadata | None) -> torch.Tensor:
    """y = x @ param^T (the module's product) plus every live adapter target of `param`, per row
    (`k3.reference.lora.lora_delta`); y itself when the call has no adapter rows or the
    parameter no adapter. Each target's rows are rounded once to y's dtype after the add. The
    delta is the module's `lora.delta` kernel entry (`k3.plugin.kernels.lora`)."""
    targets = _live(module, param, lora)
    if not targets:
        return y
    y = y.clone()
    scales, delta = module.__dict__["_lora_scales"], module.kernels.lora.delta
    for t in targets:
        y[:, t.rows] = (y[:, t.rows] + delta(x, t.a, t.b, scales, lora.token_slots)).to(y.dtype)
    return y


def expert_lora(module: K3Module, lora: LoRAMetadata | None):
    """(w13 targets, w2 targets, scales) of a MoE module's live expert adapters, as
    `k3.reference.lora.lora_experts_forward` takes them, or None without any."""
    w13, w2 = _live(module, "w13", lora), _live(module, "w2", lora)
    if not (w13 or w2):
        return None
    return ([(t.rows, t.a, t.b) for t in w13], [(t.rows, t.a, t.b) for t in w2], module.__dict__["_lora_scales"])


def merged_weight(module: K3Module, param: str, weight: torch.Tensor, slot: int) -> torch.Tensor:
    """weight + scale * B @ A of slot `slot`'s live targets of `param` (for a weight a kernel
    takes whole, MLA's kv_b_proj); `weight` itself for slot -1 or no adapter."""
    targets = _live(module, param, LoRAMetadata(torch.empty(0), ())) if slot >= 0 else []
    if not targets:
        return weight
    scales = module.__dict__["_lora_scales"]
    merged = weight.clone()
    sd = scales.dtype
    for t in targets:
        delta = (t.b[slot].to(sd) @ t.a[slot].to(sd)) * scales[slot]
        merged[t.rows] = (merged[t.rows].to(sd) + delta).to(weight.dtype)
    return merged


def has_lora(module: K3Module, param: str) -> bool:
    """Whether any adapter uses a target of `param` (allocation happened)."""
    return bool(_live(module, param, LoRAMetadata(torch.empty(0), ())))
