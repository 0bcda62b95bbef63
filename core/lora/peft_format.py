"""PEFT-format LoRA adapters: `adapter_config.json` + `adapter_model.safetensors` in a folder,
tensors named as PEFT writes them ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
[r, in] and "...lora_B.weight" [out, r]; the routed experts "...block_sparse_moe.experts.5.w1...").

`read_peft_adapter` reads and checks a folder against the model's LoRA targets
(`k3.model.lora.lora_targets_of`): every problem is a `LoRAFormatError` naming the file, the
tensor and the shape it should have. scale = lora_alpha / r (lora_alpha / sqrt(r) with
use_rslora).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from k3.model.lora import LoRATarget

__all__ = ["LoRAFormatError", "PeftAdapter", "read_peft_adapter", "PEFT_PREFIX"]

PEFT_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


class LoRAFormatError(ValueError):
    """An adapter folder k3 cannot serve; the message names the file, tensor and expected shape."""


@dataclass(frozen=True)
class PeftAdapter:
    """A checked adapter: rank, scale, and per target (name, expert or None) its (A [r, in], B [out, r])."""

    path: Path
    rank: int
    scale: float
    weights: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]]


def _config(path: Path, max_rank: int) -> tuple[int, float]:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoRAFormatError(f"LoRA adapter {path}: no {CONFIG_FILE}")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAFormatError(f"LoRA adapter {file}: not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoRAFormatError(f"LoRA adapter {file}: must hold a JSON object")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAFormatError(f"LoRA adapter {file}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoRAFormatError(f"LoRA adapter {file}: rank {r} is above max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAFormatError(f"LoRA adapter {file}: lora_alpha must be a number, got {alpha!r}")
    for key, ok in (("peft_type", lambda v: v in (None, "LORA")), ("bias", lambda v: v in (None, "none")),
                    ("use_dora", lambda v: not v), ("modules_to_save", lambda v: not v),
                    ("fan_in_fan_out", lambda v: not v)):
        if not ok(cfg.get(key)):
            raise LoRAFormatError(f"LoRA adapter {file}: {key} = {cfg.get(key)!r} is not supported "
                                  "(plain LoRA: peft_type LORA, bias none, no DoRA, no modules_to_save)")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scale)


def _target(module: str, targets: dict[str, LoRATarget]) -> tuple[LoRATarget, int | None] | None:
    if module in targets:
        return targets[module], None
    m = _EXPERT.search(module)
    if m is None:
        return None
    template = module[: m.start()] + ".experts.{expert}." + module[m.end():]
    target = targets.get(template)
    return (target, int(m.group(1))) if target is not None else None


def read_peft_adapter(path: str | Path, targets: dict[str, LoRATarget], *, max_rank: int) -> PeftAdapter:
    """Read the PEFT adapter in folder `path` and check every tensor against `targets` (the
    model's LoRA targets by name): names, ranks, shapes, A and B in pairs, finite values."""
    path = Path(path)
    if not path.is_dir():
        raise LoRAFormatError(f"LoRA adapter {path}: not a folder")
    rank, scale = _config(path, max_rank)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise LoRAFormatError(f"LoRA adapter {path}: no {WEIGHTS_FILE}")
    pairs: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            names = list(f.keys())
            tensors = {name: f.get_tensor(name) for name in names}
    except Exception as e:  # a truncated or foreign file: safetensors' own error, named
        raise LoRAFormatError(f"LoRA adapter {file}: not a safetensors file ({e})") from None
    for name, tensor in tensors.items():
        m = _TENSOR.match(name)
        if m is None or not name.startswith(PEFT_PREFIX):
            raise LoRAFormatError(f"LoRA adapter {file}: tensor {name!r} is not a PEFT LoRA weight "
                                  f"('{PEFT_PREFIX}<module>.lora_A.weight' / '.lora_B.weight')")
        module = m.group("module")[len(PEFT_PREFIX):]
        found = _target(module, targets)
        if found is None:
            raise LoRAFormatError(f"LoRA adapter {file}: tensor {name!r}: the model has no adaptable module "
                                  f"{module!r}")
        target, expert = found
        if expert is not None and not 0 <= expert < target.experts:
            raise LoRAFormatError(f"LoRA adapter {file}: tensor {name!r}: expert {expert} is not below "
                                  f"{target.experts}")
        which = m.group("which")
        want = (rank, target.in_features) if which == "A" else (target.out_features, rank)
        if tuple(tensor.shape) != want:
            raise LoRAFormatError(f"LoRA adapter {file}: tensor {name!r} must be {list(want)} (rank {rank}), "
                                  f"got {list(tensor.shape)}")
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            raise LoRAFormatError(f"LoRA adapter {file}: tensor {name!r} must hold finite floating-point values")
        pairs.setdefault((target.name, expert), {})[which] = tensor
    if not pairs:
        raise LoRAFormatError(f"LoRA adapter {file}: holds no LoRA tensors")
    for (target_name, expert), ab in pairs.items():
        if len(ab) != 2:
            missing = "lora_B" if "A" in ab else "lora_A"
            module = target_name if expert is None else target_name.replace("{expert}", str(expert))
            raise LoRAFormatError(f"LoRA adapter {file}: {PEFT_PREFIX}{module}.{missing}.weight is missing")
    return PeftAdapter(path, rank, scale, {key: (ab["A"], ab["B"]) for key, ab in pairs.items()})
