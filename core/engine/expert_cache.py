"""The expert cache: MXFP4 routed experts dequantised once at load and held dense in the model's
dtype (`MoE.hold_experts_dense`), for platforms whose `moe.experts` kernel has no fast MXFP4
path. The ppu platform's torch-native experts then read only the routed experts' bf16 weights
(2 bytes a weight) where dequantising MXFP4 on the fly in eager torch moves 6.5 or more bytes a
weight (platforms/ppu/README.md has the numbers).

The mode is `EngineConfig.expert_cache` (`--expert-cache`), else the platform's default
(`k3_config_defaults` key "expert_cache"; ppu: "auto", or $K3_PPU_EXPERT_CACHE), else "off":
- "off": the experts stay MXFP4;
- "on": held dense whatever it costs the KV cache;
- "auto": held dense when the capacity plan with them still fits (the planner's own criterion,
  `k3.cache.capacity.FITS_CRITERION`: weights + workspace within the usable memory and a cache
  of at least one max-length request). Only on a device that reports its memory size: the CPU
  (whose cache is sized by kv_cache_memory_gib) stays off unless "on".
Whatever the mode, the capacity plan counts the experts as the engine holds them
(`plan_capacity(expert_cache=...)`), so the KV cache is sized after the dense stacks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.log import get_logger

from .config import EXPERT_CACHE_MODES, GIB

logger = get_logger(__name__)


@dataclass(frozen=True)
class ExpertCacheDecision:
    """What the engine does with the routed experts: `on` (held dense) and why, in one sentence."""

    mode: str
    on: bool
    reason: str


def resolve_mode(config, platform) -> str:
    """The requested mode: the engine option, else the platform's default, else "off"."""
    mode = config.expert_cache or platform.config_defaults().get("expert_cache") or "off"
    if mode not in EXPERT_CACHE_MODES:
        raise ValueError(f"expert_cache must be auto, on or off, got {mode!r} (the platform's default "
                         "or --expert-cache)")
    return mode


def decide(config, cfg, platform, plan_with_cache) -> ExpertCacheDecision:
    """Hold the experts dense? plan_with_cache(): the engine's capacity report with the experts
    counted dense (called only for "auto" on a device with a memory size)."""
    mode = resolve_mode(config, platform)
    if not cfg.experts_mxfp4:
        return ExpertCacheDecision(mode, False, "the routed experts are not MXFP4")
    if mode != "auto":
        return ExpertCacheDecision(mode, mode == "on", f"expert_cache {mode}")
    if torch.device(platform.info.device).type == "cpu" or not platform.capabilities.memory_bytes:
        return ExpertCacheDecision(mode, False, "auto: the device reports no memory size to plan against; "
                                                "expert_cache on forces it")
    report = plan_with_cache()
    dense = report.weight_terms.routed_experts / GIB
    if report.fits:
        return ExpertCacheDecision(mode, True, f"auto: {dense:.1f} GiB of dense experts fit; the KV cache then holds "
                                               f"{report.concurrent_max_len_requests:,} max-length requests")
    return ExpertCacheDecision(mode, False, f"auto: {dense:.1f} GiB of dense experts do not leave a cache of one "
                                            "max-length request; expert_cache on forces it")


def hold_experts_dense(model) -> int:
    """Every MoE layer's MXFP4 experts held dense (`MoE.hold_experts_dense`), a layer at a time,
    each layer's freed planes returned to the device before the next layer's stacks are
    allocated (they are smaller than a stack, so the allocator could not reuse them; the KV
    cache is allocated next). Returns the bytes of the dense stacks."""
    from k3.model.ffn import MoE

    device = next(model.parameters()).device
    module = torch.get_device_module(device) if device.type != "cpu" else None
    held = 0
    for layer in [m for m in model.modules() if isinstance(m, MoE)]:
        held += layer.hold_experts_dense()
        if module is not None and hasattr(module, "empty_cache"):
            module.empty_cache()
    return held


def apply(config, cfg, platform, model, plan_with_cache) -> ExpertCacheDecision:
    """`decide`, then hold the experts dense when it says so; logs the decision."""
    decision = decide(config, cfg, platform, plan_with_cache)
    if decision.on:
        held = hold_experts_dense(model)
        logger.info(f"expert cache on ({decision.reason}): {held / GIB:.2f} GiB ({held:,} bytes) of routed experts "
                    f"held dense in {model.dtype}")
    elif decision.mode != "off" and cfg.experts_mxfp4:
        logger.info(f"expert cache off ({decision.reason})")
    return decision
