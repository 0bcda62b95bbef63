"""Helpers of the LoRA tests: write PEFT adapters for k3-tiny, merge one into a model's weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from k3.model.lora import lora_targets_of
from k3.quant.mxfp4 import MXFP4Tensor

PREFIX = "base_model.model."


def write_adapter(folder: Path, model, *, rank: int = 4, alpha: float = 8.0, seed: int = 0,
                  every: int = 1, std: float = 0.05, extra: dict | None = None) -> Path:
    """A PEFT adapter of random A / B on every `every`-th LoRA target of `model` (every
    expert of a stacked one), named as PEFT writes them. Returns the folder."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    modules = []
    for i, t in enumerate(sorted(lora_targets_of(model).values(), key=lambda t: t.name)):
        if i % every:
            continue
        names = [t.name] if t.experts is None else [t.name.replace("{expert}", str(e)) for e in range(t.experts)]
        for name in names:
            tensors[f"{PREFIX}{name}.lora_A.weight"] = torch.randn(rank, t.in_features, generator=g) * std
            tensors[f"{PREFIX}{name}.lora_B.weight"] = torch.randn(t.out_features, rank, generator=g) * std
        modules.append(t.name.rsplit(".", 1)[-1])
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(set(modules)),
              "bias": "none", "base_model_name_or_path": "k3-tiny", **(extra or {})}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@torch.no_grad()
def merge_adapter(model, folder: Path) -> None:
    """W += scale * B @ A for every tensor of the adapter in `folder`, on `model`'s own weights
    (MXFP4 experts dequantised to dense stacks first): the independent computation the LoRA
    path is checked against. Reads the files itself (not through k3.lora)."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    targets = lora_targets_of(model)
    dense: dict[tuple[int, str], torch.Tensor] = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        name = key[len(PREFIX): -len(".lora_A.weight")]
        expert = None
        if name not in targets:                         # a routed expert: experts.<e>.w1
            head, rest = name.split(".experts.")
            e, tail = rest.split(".", 1)
            name, expert = f"{head}.experts.{{expert}}.{tail}", int(e)
        t = targets[name]
        delta = scale * (b.double() @ a.double())
        if expert is None:
            w = getattr(t.module, t.param)
            w[t.rows] = (w[t.rows].double() + delta).to(w.dtype)
            continue
        moe = t.module
        if (id(moe), t.param) not in dense:
            w13, w2 = moe.expert_weights()
            for param, w in (("w13", w13), ("w2", w2)):
                full = w.dequantize(model.dtype) if isinstance(w, MXFP4Tensor) else w.clone()
                dense[id(moe), param] = full
        w = dense[id(moe), t.param]
        w[expert, t.rows] = (w[expert, t.rows].double() + delta).to(w.dtype)
    for module in {id(t.module): t.module for t in targets.values() if t.experts is not None}.values():
        if (id(module), "w13") in dense:
            w13, w2 = dense[id(module), "w13"], dense[id(module), "w2"]
            module.expert_weights = lambda w13=w13, w2=w2: (w13, w2)


def teacher_forced_lora(model, prompts: list[list[int]], adapters: list[int], *, chunk: int | None = None):
    """`model_runs.teacher_forced` with a LoRA slot per prompt (-1: the base model)."""
    from model_runs import teacher_forced

    return teacher_forced(model, prompts, chunk=chunk, adapters=adapters)
