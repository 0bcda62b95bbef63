"""Write an HF-style checkpoint directory: config.json, generation_config.json, sharded
`*.safetensors` with `model.safetensors.index.json`."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from k3.config import K3Config

INDEX_FILE = "model.safetensors.index.json"


def write_checkpoint(out_dir: str | Path, cfg: K3Config, tensors: Iterable[tuple[str, torch.Tensor]], *,
                     max_shard_bytes: int = 2 * 1024 ** 3, progress=None) -> Path:
    """Stream (name, tensor) pairs into shards of at most `max_shard_bytes`; returns the dir.

    progress: optional callable(bytes_written) for a progress bar.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, total = 0, 0
    temp_names: list[str] = []

    def flush():
        name = f"model-{len(temp_names) + 1:05d}.safetensors.tmp"
        save_file(shards[-1], str(out / name), metadata={"format": "pt"})
        temp_names.append(name)

    weight_map: dict[str, int] = {}
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            flush()
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        weight_map[name] = len(shards) - 1
        size += nbytes
        total += nbytes
        if progress:
            progress(nbytes)
    flush()
    count = len(temp_names)
    final = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for tmp, name in zip(temp_names, final):
        (out / tmp).replace(out / name)
    index = {"metadata": {"total_size": total}, "weight_map": {n: final[i] for n, i in sorted(weight_map.items())}}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    write_config(out, cfg)
    return out


def write_config(out: Path, cfg: K3Config) -> None:
    """config.json and generation_config.json of `cfg` into `out`."""
    cfg.to_json_file(out / "config.json")
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids),
                  "pad_token_id": cfg.pad_token_id, "do_sample": True, "temperature": 1.0, "top_p": 1.0}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


# parameters the model holds in fp32 for its own arithmetic (an exact upcast at load) that
# checkpoints publish in the model's dtype, as K3's do: the MoE router's gate
HELD_IN_FP32 = ("gate",)


def model_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """(published name, tensor) of every checkpoint tensor of a TP = 1 model, for saving it."""
    from .names import published_name

    if model.parallel.world_size != 1:
        raise ValueError("model_tensors saves a whole model: gather a tensor-parallel model first")
    if model.cfg.experts_int4:
        raise ValueError("model_tensors cannot save W4A16 experts: the model holds them dequantised (the packed "
                         "planes are freed at load); save the checkpoint's own tensors instead")
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    model_dtype = model.model.norm.dtype
    out = []
    for template, param, spec in model.weight_specs():
        source = tensors[param]
        if param.rsplit(".", 1)[-1] in HELD_IN_FP32:
            source = source.to(model_dtype)
        for e in range(spec.stack[0]) if spec.stack else (None,):
            index = ((e,) if e is not None else ()) + tuple(spec.dest)
            out.append((published_name(template, model.cfg, e), (source[index] if index else source).clone()))
    return out
