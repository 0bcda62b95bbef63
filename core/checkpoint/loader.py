"""Load an HF-style safetensors checkpoint into a (possibly tensor-parallel) K3 model.

The loader walks the shards one at a time and reads, for each tensor, only the slice this
rank holds (safetensors slices straight from the memory-mapped file), copying it into the
model's stacked or fused parameter. A bad checkpoint is a `CheckpointError` that names the
tensor: missing (with the expected shape and dtype), unexpected, mis-shaped or of the wrong
dtype kind; a shape error also names the config fields that set the expected shape. A fused
tensor (`k3.checkpoint.families`, e.g. transformers' stacked experts) is checked against its
parts and split into them.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from k3.config import K3Config
from k3.dtypes import torch_dtype
from k3.log import get_logger

from .names import canonical_name, published_name
from .shard_file import open_shard
from .writer import INDEX_FILE

logger = get_logger(__name__)

_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
_MAX_LISTED = 8
_LAYER_PREFIX = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(ValueError):
    """The checkpoint does not match the model; the message names the tensors."""


@dataclass
class LoadReport:
    """tensors_read: tensors whose data this rank read; skipped: reason -> count of tensors not
    read ("another rank's expert": the experts other EP (or, without EP, TP) ranks hold)."""

    tensors_read: int = 0
    skipped: Counter = field(default_factory=Counter)


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
# packed planes are read as stored: the safetensors dtype each needs, and what it holds
_PACKED_DTYPES = {torch.uint8: ("U8", "packed MXFP4 data or E8M0 scales"),
                  torch.int32: ("I32", "packed int4 data, eight values a word")}
_SHAPE_SUFFIX, _PACKED_SUFFIX = ".weight_shape", ".weight_packed"


_FIELD = re.compile(r"[A-Za-z_][A-Za-z_0-9.]*")


def explain_dims(dims: tuple[str, ...], cfg: K3Config | None) -> str:
    """" (rows = linear_head_dim, columns = hidden_size)": the config fields behind each
    dimension of an expected shape, named as the config file spells them; "" when unknown."""
    if not dims or cfg is None:
        return ""
    labels = ("rows", "columns") if len(dims) == 2 else ("size",) if len(dims) == 1 else \
        tuple(f"dim {i}" for i in range(len(dims)))
    said = [f"{label} = {_FIELD.sub(lambda m: cfg.field_name(m.group()), expr)}"
            for label, expr in zip(labels, dims) if not expr.isdigit()]
    return f" ({', '.join(said)})" if said else ""


def _describe(spec, dtype: torch.dtype, cfg: K3Config | None = None, *, shape=None, dims=None) -> str:
    """The expected shape and dtype of a checkpoint tensor, as an error states them (with the
    config fields behind the shape when `cfg` is given)."""
    shape = list(spec.full_shape if shape is None else shape)
    fields = explain_dims(spec.dims if dims is None else dims, cfg)
    if dtype in _PACKED_DTYPES:
        return f"shape {shape}{fields}, dtype {_PACKED_DTYPES[dtype][0]}"
    return f"shape {shape}{fields}, dtype {_SAFETENSORS_NAMES.get(dtype, dtype)} (any float dtype is converted)"


def load_checkpoint(model, model_dir: str | Path, *, progress: bool = True, part: str = "text",
                    vision_notice: bool = True) -> LoadReport:
    """Fill `model` (a K3ForCausalLM built for this rank) from a checkpoint directory; W4A16
    routed experts are dequantised to the model's dtype once every tensor is read (a packed
    weight's `weight_shape` record, when present, is checked against it).

    part "mtp": `model` is an MTP layer (`k3.model.mtp.MTPLayer`) filled from the checkpoint's
    MTP tensors; the text model's tensors and the other MTP layers' are skipped.
    vision_notice: say how many vision tensors were skipped (off for a caller that loads the
    tower itself, as the engine does)."""
    model_dir = Path(model_dir)
    cfg: K3Config = model.cfg
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    targets = {template: (tensors[param], spec) for template, param, spec in model.weight_specs()}
    layers = {m.group(1) for m in map(_LAYER_PREFIX.match, targets) if m} if part == "mtp" else None
    files = shard_files(model_dir)
    seen: set[tuple[str, int | None]] = set()
    unexpected: list[str] = []
    report = LoadReport()
    bar = tqdm(total=len(files), desc="loading shards", unit="shard", disable=not progress, file=sys.stderr)
    try:
        for path in files:
            with open_shard(path, CheckpointError) as f:
                _read_shard(f, cfg, targets, seen, unexpected, report, part=part, layers=layers)
            bar.update(1)
    finally:
        bar.close()       # before any error, so it starts a line of its own
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
    if report.skipped.get("vision") and part == "text" and vision_notice:
        logger.info(f"skipped {report.skipped['vision']} vision tensors (the tower loads through k3.vision.weights)")
    dequantize_int4_experts(model)
    return report


def _read_shard(f, cfg: K3Config, targets: dict, seen: set, unexpected: list[str], report: LoadReport, *,
                part: str = "text", layers: set[str] | None = None) -> None:
    """Copy every tensor of one open shard `f` this rank needs into `targets`; record the
    others in `unexpected` (no such tensor) or `report.skipped`. layers: with part "mtp", the
    MTP layer indices `targets` holds (the others are skipped)."""
    for key in f.keys():
        name = canonical_name(key, cfg, part)
        if name.skip_reason:
            report.skipped[name.skip_reason] += 1
            continue
        layer = _LAYER_PREFIX.match(name.template)
        if layers is not None and layer and layer.group(1) not in layers:
            report.skipped["unused MTP layer"] += 1
            continue
        if name.fused is not None:
            parts = [targets.get(t) for t in name.fused.templates]
            if any(p is None for p in parts):
                unexpected.append(key)
                continue
            _load_fused(f, key, name.fused, parts, cfg, seen)
            report.tensors_read += 1
            continue
        packed = targets.get(name.template[:-len(_SHAPE_SUFFIX)] + _PACKED_SUFFIX) \
            if name.template.endswith(_SHAPE_SUFFIX) else None
        if packed is not None:                  # compressed-tensors' record of [out, in]
            _check_recorded_shape(f, key, packed[1], cfg)
            continue
        target = targets.get(name.template)
        if target is None or (name.expert is None) != (target[1].stack is None):
            unexpected.append(key)
            continue
        if not _load_one(f, key, name, *target, seen, cfg):
            report.skipped["another rank's expert"] += 1
            continue
        report.tensors_read += 1


def dequantize_int4_experts(model) -> None:
    """Turn every MoE's loaded W4A16 planes into its dense expert stacks (`MoE.dequantize_int4_experts`)."""
    from k3.model.ffn import MoE

    for module in model.modules():
        if isinstance(module, MoE):
            module.dequantize_int4_experts()


def _check_recorded_shape(f, key: str, spec, cfg: K3Config) -> None:
    """A packed weight's `weight_shape` (int [2]) must be the logical [out, in] its
    weight_packed [out, in / values a word] holds."""
    expected = [spec.full_shape[0], spec.full_shape[1] * spec.logical_per_element]
    view = f.get_slice(key)
    dtype = view.get_dtype()
    values = f.get_tensor(key).tolist() if dtype in ("I64", "I32", "I16", "I8", "U8") else None
    if values != expected:
        dims = (spec.dims[0], spec.dims[1].rsplit(" / ", 1)[0]) if spec.dims else ()
        raise CheckpointError(f"tensor {key} records shape {values if values is not None else dtype}, expected "
                              f"{expected}{explain_dims(dims, cfg)} (the logical shape of its weight_packed "
                              f"{list(spec.full_shape)})")


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
        with open_shard(path, CheckpointError) as f:
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


def _mark_seen(seen: set, key: str, template: str, expert: int | None) -> None:
    if (template, expert) in seen:
        raise CheckpointError(f"tensor {key} appears twice in the checkpoint"
                              + ("" if template in key else f" (as {template}, expert {expert})"))
    seen.add((template, expert))


def _check_dtype(key: str, dtype: str, param: torch.Tensor) -> None:
    if param.dtype in _PACKED_DTYPES:
        want, what = _PACKED_DTYPES[param.dtype]
        if dtype != want:
            raise CheckpointError(f"tensor {key} has dtype {dtype}, expected {want} ({what})")
        return
    if dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f"tensor {key} has dtype {dtype}, expected a float dtype (BF16, F16, F32 or F64)")


def _destination(key: str, spec, expert: int | None):
    """Index into the parameter for this tensor, or None for another rank's expert."""
    if not spec.stack:
        return spec.dest
    total, start, count = spec.stack
    if expert >= total:
        raise CheckpointError(f"tensor {key}: expert {expert} does not exist (num_experts = {total})")
    if not start <= expert < start + count:
        return None
    return (expert - start, *spec.dest)


def _store(param: torch.Tensor, dest, tensor: torch.Tensor) -> None:
    target = param[dest] if dest else param
    target.copy_(tensor.to(param.dtype))


def _load_one(f, key: str, name, param: torch.Tensor, spec, seen: set, cfg: K3Config | None = None) -> bool:
    """Check one tensor and read this rank's part of it; False: another rank's expert (not read)."""
    _mark_seen(seen, key, name.template, name.expert)
    view = f.get_slice(key)
    shape, dtype = tuple(view.get_shape()), view.get_dtype()
    if shape != spec.full_shape and shape not in spec.alt_shapes:
        raise CheckpointError(f"tensor {key} has shape {list(shape)} ({dtype}), expected "
                              f"{_describe(spec, param.dtype, cfg)}")
    _check_dtype(key, dtype, param)
    dest = _destination(key, spec, name.expert)
    if dest is None:
        return False                    # another rank's expert: its data is never read
    if shape == spec.full_shape and spec.shard is not None:
        dim, begin, size = spec.shard
        index = tuple(slice(begin, begin + size) if i == dim else slice(None) for i in range(len(shape)))
        tensor = view[index]
    else:
        tensor = f.get_tensor(key).reshape(spec.full_shape)
        if spec.shard is not None:
            tensor = tensor.narrow(spec.shard[0], spec.shard[1], spec.shard[2])
    _store(param, dest, tensor)
    return True


def _fused_shapes(fused, specs) -> tuple[tuple[int, ...], list[tuple[int, ...]], tuple[str, ...]]:
    """(expected shape, accepted alternatives, dims) of a fused tensor from its parts' specs."""
    rows = sum(s.full_shape[0] for s in specs)
    expected = (rows, *specs[0].full_shape[1:])
    alts = [(rows, *alt[1:]) for alt in specs[0].alt_shapes]
    firsts = [s.dims[0] if s.dims else "?" for s in specs]
    wrap = [f"({d})" if "+" in d else d for d in firsts]
    first = f"{len(specs)} * {wrap[0]}" if len(set(firsts)) == 1 and len(specs) > 1 else " + ".join(wrap)
    dims = (first, *specs[0].dims[1:]) if specs[0].dims else ()
    if fused.rule.experts:
        total = specs[0].stack[0]
        expected, alts = (total, *expected), [(total, *a) for a in alts]
        dims = ("num_experts", *dims) if dims else ()
    return expected, alts, dims


def _load_fused(f, key: str, fused, parts, cfg: K3Config, seen: set) -> None:
    """A tensor holding several canonical ones (`k3.checkpoint.families.FusedTensor`): check its
    shape against theirs and copy each part (each local expert's parts) into its parameter."""
    specs = [spec for _, spec in parts]
    expected, alts, dims = _fused_shapes(fused, specs)
    view = f.get_slice(key)
    shape, dtype = tuple(view.get_shape()), view.get_dtype()
    if shape != expected and shape not in alts:
        names = ", ".join(part.split(".")[-2] for part in fused.rule.parts)     # q_conv1d, ...; w1, w3
        raise CheckpointError(
            f"tensor {key} has shape {list(shape)} ({dtype}), expected "
            f"{_describe(specs[0], parts[0][0].dtype, cfg, shape=expected, dims=dims)}: {fused.rule.family} "
            f"stacks {names} along dim {1 if fused.rule.experts else 0}"
            + (" for each expert" if fused.rule.experts else ""))
    _check_dtype(key, dtype, parts[0][0])
    for expert in range(expected[0]) if fused.rule.experts else (None,):
        offset = 0
        for (param, spec), template in zip(parts, fused.templates):
            rows = spec.full_shape[0]
            index = ((slice(expert, expert + 1),) if expert is not None else ()) + (slice(offset, offset + rows),)
            offset += rows
            _mark_seen(seen, key, template, expert)
            dest = _destination(key, spec, expert)
            if dest is None:
                continue                # another rank's expert
            tensor = view[index].reshape(spec.full_shape)
            if spec.shard is not None:
                tensor = tensor.narrow(spec.shard[0], spec.shard[1], spec.shard[2])
            _store(param, dest, tensor)


def load_model(model_dir: str | Path, *, dtype: torch.dtype | None = None, parallel=None, device=None,
               progress: bool = True):
    """Build the model of `model_dir/config.json` for this rank and load its weights."""
    from k3.model import K3ForCausalLM

    cfg = K3Config.from_pretrained(model_dir)
    dtype = dtype or torch_dtype(cfg.dtype)
    model = K3ForCausalLM(cfg, parallel=parallel, dtype=dtype, device=device)
    load_checkpoint(model, model_dir, progress=progress)
    return model
