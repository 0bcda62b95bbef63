"""Deterministic random weights for a K3-architecture config, in the checkpoint's own layout.

Each tensor is drawn from a generator seeded by (seed, tensor name), so a checkpoint is the
same on every machine and any single tensor can be regenerated alone. Scales keep the
forward well conditioned (projections ~ 1/sqrt(fan_in), norms ~ 1, KDA gates in range), and
lm_head is drawn large (std 1, so logit std ~ sqrt(hidden)) to give wide top-1 / top-2 logit
margins for token-equality tests (DESIGN.md "Testing equality"). MXFP4 experts are drawn as
codes and E8M0 scales directly, so the bf16 weights they dequantise to are exact; W4A16
experts as random int4 words and positive scales of the same weight rms.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import torch

from k3.config import K3Config
from k3.dtypes import torch_dtype

from .names import published_name

_FP32_TENSORS = ("A_log", "dt_bias", "e_score_correction_bias")
E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # rms of a uniform code
INT4_RMS = math.sqrt(sum(q * q for q in range(-8, 8)) / 16)                  # rms of a uniform int4


def checkpoint_tensor_specs(cfg: K3Config) -> list[tuple[str, tuple[int, ...], torch.dtype, int | None]]:
    """(canonical template, full shape, checkpoint dtype, expert or None) of every tensor: the
    text model's, then each MTP layer's (`num_nextn_predict_layers`; sharing the target's
    embedding and lm_head, `k3.model.mtp`)."""
    from k3.model import K3ForCausalLM, ParallelContext, reference_kernels
    from k3.model.mtp import MTPLayer

    modules = [K3ForCausalLM(cfg, dtype=torch.float32, device="meta")]
    modules += [MTPLayer(cfg, i, kernels=reference_kernels(), parallel=ParallelContext(), dtype=torch.float32,
                         device="meta") for i in range(cfg.num_nextn_predict_layers)]
    out = []
    for model in modules:
        out += _module_tensor_specs(model, cfg)
    return out


def _module_tensor_specs(model, cfg: K3Config) -> list[tuple[str, tuple[int, ...], torch.dtype, int | None]]:
    weights = dict(model.named_parameters())
    weights.update(model.named_buffers())
    out = []
    for template, param, spec in model.weight_specs():
        stored = weights[param].dtype
        if stored in (torch.uint8, torch.int32):   # packed planes: MXFP4 bytes and scales, int4 words
            dtype = stored
        elif template.rsplit(".", 1)[-1] in _FP32_TENSORS:
            dtype = torch.float32
        else:
            dtype = torch_dtype(cfg.dtype)
        for e in range(spec.stack[0]) if spec.stack else (None,):
            out.append((template, spec.full_shape, dtype, e))
    return out


def _generator(seed: int, name: str, device=None) -> torch.Generator:
    g = torch.Generator(device=device) if device is not None else torch.Generator()
    return g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))


def random_tensor(template: str, shape: tuple[int, ...], dtype: torch.dtype, *, seed: int,
                  name: str, cfg: K3Config, device=None) -> torch.Tensor:
    """One tensor (see the module docstring for the scales). device: where it is drawn (with that
    device's generator, so the values depend on the device; None: the CPU, the checkpoints')."""
    g = _generator(seed, name, device)
    kw = {"generator": g, "device": device}
    leaf = template.rsplit(".", 2)
    kind = leaf[-2] if leaf[-1] in ("weight", "bias", "weight_packed", "weight_scale") else leaf[-1]
    fan_in = shape[-1] if len(shape) > 1 else 1
    if dtype == torch.int32:                                 # W4A16 words: eight uniform int4 values
        return torch.randint(-2 ** 31, 2 ** 31, shape, **kw, dtype=torch.int64).to(torch.int32)
    if template.endswith("weight_scale") and dtype.is_floating_point:   # W4A16 scales: weights of rms ~ 1/sqrt(fan_in)
        in_features = shape[-1] * cfg.quantization.group_size
        rms = in_features ** -0.5 / INT4_RMS
        return (rms * torch.exp(0.25 * torch.randn(shape, **kw))).to(dtype)
    if dtype == torch.uint8:
        if template.endswith("weight_packed"):
            return torch.randint(0, 256, shape, **kw, dtype=torch.uint8)
        # E8M0 scale giving weights of rms ~ 1/sqrt(fan_in): fan_in = 32 columns per scale byte
        in_features = shape[-1] * 32
        exponent = round(math.log2(in_features ** -0.5 / E2M1_RMS))
        return (127 + exponent + torch.randint(-1, 1, shape, **kw)).to(torch.uint8)
    if kind == "A_log":          # decay rates exp(A_log) in [1, 16]
        t = torch.rand(shape, **kw) * math.log(16)
    elif kind == "dt_bias":
        t = 0.5 * torch.randn(shape, **kw)
    elif kind.endswith("conv1d"):
        t = 0.5 * torch.randn(shape, **kw)
    elif kind == "e_score_correction_bias":
        t = 0.1 * torch.randn(shape, **kw)
    elif len(shape) == 1 or kind.endswith("norm") and template.endswith(".bias"):
        # norm weights near 1 (biases near 0)
        t = 0.1 * torch.randn(shape, **kw) + (0.0 if template.endswith(".bias") else 1.0)
    elif kind.endswith("_res_proj"):   # AttnRes pseudo-queries: not zero, so the mix is exercised
        t = torch.randn(shape, **kw) * shape[-1] ** -0.5
    elif kind == "lm_head":
        t = torch.randn(shape, **kw)
    elif kind == "embed_tokens":
        t = torch.randn(shape, **kw)
    else:
        t = torch.randn(shape, **kw) * fan_in ** -0.5
    return t.to(dtype)


def random_checkpoint(cfg: K3Config, *, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(published name, tensor) of every tensor of a random checkpoint, in a stable order."""
    for template, shape, dtype, expert in checkpoint_tensor_specs(cfg):
        name = published_name(template, cfg, expert)
        yield name, random_tensor(template, shape, dtype, seed=seed, name=name, cfg=cfg)
    yield from _random_vision_tensors(cfg, seed=seed)


def _random_vision_tensors(cfg: K3Config, *, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The MoonViT tower + projector of a config with a vision_config, after the text tensors (their own
    generator: the text tensors are the same with or without a tower)."""
    vision = cfg.extra_top.get("vision_config")
    if not vision:
        return
    from k3.vision import MoonViTConfig, init_vision_params

    yield from init_vision_params(MoonViTConfig.from_dict(vision), seed=seed, dtype=torch_dtype(cfg.dtype)).items()


def random_draft_checkpoint(raw_config: dict, *, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a random DSpark draft checkpoint (names as DSparkDraft loads them)."""
    from k3.model.dspark import DSparkConfig, DSparkDraft

    cfg = DSparkConfig.from_dict(raw_config)
    draft = DSparkDraft(cfg, dtype=torch.float32, device="meta")
    dtype = torch_dtype(cfg.dtype)
    for template, _, spec in draft.weight_specs():
        yield template, random_tensor(template, spec.full_shape, dtype, seed=seed, name=template, cfg=None)
