"""Load an HF-style safetensors checkpoint into a (possibly tensor-parallel) K3 model.

The loader walks the shards one at a time and reads, for each tensor, only the slice this
rank holds (safetensors slices straight from the memory-mapped file), copying it into the
model's stacked or fused parameter. A bad checkpoint is a `CheckpointError` that names the
tensor: missing (with the expected shape and dtype), unexpected, mis-shaped or of the wrong
dtype kind.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from k3.config import K3Config

from .names import canonical_name, published_name
from .writer import INDEX_FILE

_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
_MAX_LISTED = 8


class CheckpointError(ValueError):
    """The checkpoint does not match the model; the message names the tensors."""


@dataclass
class LoadReport:
    tensors_read: int = 0
    skipped: Counter = field(default_factory=Counter)   # reason -> count


def shard_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint (from its index when it has one)."""
    index = model_dir / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(f.name) for f in files if not f.exists()]
        if absent:
            raise CheckpointError(f"{index} lists shard files that do not exist: {', '.join(absent)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


_SAFETENSORS_NAMES = {torch.uint8: "U8", torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
                      torch.float64: "F64"}


def _describe(spec, dtype: torch.dtype) -> str:
    """The expected shape and dtype of a checkpoint tensor, as an error states them."""
    if dtype == torch.uint8:
        return f"shape {list(spec.full_shape)}, dtype U8"
    return f"shape {list(spec.full_shape)}, dtype {_SAFETENSORS_NAMES.get(dtype, dtype)} (any float dtype is converted)"


def load_checkpoint(model, model_dir: str | Path, *, progress: bool = True) -> LoadReport:
    """Fill `model` (a K3ForCausalLM built for this rank) from a checkpoint directory."""
    model_dir = Path(model_dir)
    cfg: K3Config = model.cfg
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    targets = {template: (tensors[param], spec) for template, param, spec in model.weight_specs()}
    files = shard_files(model_dir)
    seen: set[tuple[str, int | None]] = set()
    unexpected: list[str] = []
    report = LoadReport()
    bar = tqdm(total=len(files), desc="loading shards", unit="shard", disable=not progress, file=sys.stderr)
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = canonical_name(key, cfg)
                if name.skip_reason:
                    report.skipped[name.skip_reason] += 1
                    continue
                target = targets.get(name.template)
                if target is None or (name.expert is None) != (target[1].stack is None):
                    unexpected.append(key)
                    continue
                _load_one(f, key, name, *target, seen)
                report.tensors_read += 1
        bar.update(1)
    bar.close()
    missing = []
    for template, (param, spec) in targets.items():
        experts = range(spec.stack[0]) if spec.stack else (None,)
        missing += [f"{published_name(template, cfg, e)} ({_describe(spec, param.dtype)})"
                    for e in experts if (template, e) not in seen]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): " + "; ".join(missing[:_MAX_LISTED])
                        + (" ..." if len(missing) > _MAX_LISTED else ""))
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): " + ", ".join(unexpected[:_MAX_LISTED])
                        + (" ..." if len(unexpected) > _MAX_LISTED else ""))
    if problems:
        raise CheckpointError(f"checkpoint {model_dir} does not match the config: " + " | ".join(problems))
    if report.skipped.get("vision"):
        print(f"k3: skipped {report.skipped['vision']} vision tensors (no vision tower yet)", file=sys.stderr)
    return report


def load_plain(module, model_dir: str | Path) -> LoadReport:
    """Fill a K3Module whose checkpoint names are its own (no prefixes, no sharding, no
    experts), e.g. a DSpark draft. Same errors as load_checkpoint."""
    from .names import CanonicalName

    model_dir = Path(model_dir)
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    targets = {template: (tensors[param], spec) for template, param, spec in module.weight_specs()}
    seen: set = set()
    unexpected: list[str] = []
    report = LoadReport()
    for path in shard_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key not in targets:
                    unexpected.append(key)
                    continue
                _load_one(f, key, CanonicalName(key), *targets[key], seen)
                report.tensors_read += 1
    missing = [f"{t} ({_describe(spec, param.dtype)})" for t, (param, spec) in targets.items() if (t, None) not in seen]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {model_dir} does not match its config: missing {missing[:_MAX_LISTED]}, "
                              f"unexpected {unexpected[:_MAX_LISTED]}")
    return report


def _load_one(f, key: str, name, param: torch.Tensor, spec, seen: set) -> None:
    seen_key = (name.template, name.expert)
    if seen_key in seen:
        raise CheckpointError(f"tensor {key} appears twice in the checkpoint")
    seen.add(seen_key)
    view = f.get_slice(key)
    shape, dtype = tuple(view.get_shape()), view.get_dtype()
    if shape != spec.full_shape and shape not in spec.alt_shapes:
        raise CheckpointError(f"tensor {key} has shape {list(shape)} ({dtype}), expected {_describe(spec, param.dtype)}")
    if param.dtype == torch.uint8 and dtype != "U8":
        raise CheckpointError(f"tensor {key} has dtype {dtype}, expected U8 (packed MXFP4 data or E8M0 scales)")
    if param.dtype != torch.uint8 and dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f"tensor {key} has dtype {dtype}, expected a float dtype (BF16, F16, F32 or F64)")
    dest = spec.dest
    if spec.stack:
        total, start, count = spec.stack
        if name.expert >= total:
            raise CheckpointError(f"tensor {key}: expert {name.expert} does not exist (num_experts = {total})")
        if not start <= name.expert < start + count:
            return                      # another rank's expert
        dest = (name.expert - start, *dest)
    if shape == spec.full_shape and spec.shard is not None:
        dim, begin, size = spec.shard
        index = tuple(slice(begin, begin + size) if i == dim else slice(None) for i in range(len(shape)))
        tensor = view[index]
    else:
        tensor = f.get_tensor(key).reshape(spec.full_shape)
        if spec.shard is not None:
            tensor = tensor.narrow(spec.shard[0], spec.shard[1], spec.shard[2])
    target = param[dest] if dest else param
    target.copy_(tensor.to(param.dtype))


def load_model(model_dir: str | Path, *, dtype: torch.dtype | None = None, parallel=None, device=None,
               progress: bool = True):
    """Build the model of `model_dir/config.json` for this rank and load its weights."""
    from k3.model import K3ForCausalLM

    cfg = K3Config.from_pretrained(model_dir)
    dtype = dtype or _FLOAT_DTYPES[{"bfloat16": "BF16", "float16": "F16", "float32": "F32",
                                    "float64": "F64"}[cfg.dtype]]
    model = K3ForCausalLM(cfg, parallel=parallel, dtype=dtype, device=device)
    load_checkpoint(model, model_dir, progress=progress)
    return model
