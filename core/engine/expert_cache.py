"""The expert cache: MXFP4 routed experts dequantised once at load and held dense in the model's
dtype (`MoE.hold_experts_dense`), for platforms whose `moe.experts` kernel has no fast MXFP4
path. The ppu platform's torch-native experts then read only the routed experts' bf16 weights
(2 bytes a weight) where dequantising MXFP4 on the fly in eager torch moves 6.5 or more bytes a
weight (platforms/ppu/README.md has the numbers).

The mode is `EngineConfig.expert_cache` (`--expert-cache`), else the platform's default
(`k3_config_defaults` key "expert_cache"; ppu: "auto", or $K3_PPU_EXPERT_CACHE), else "off":
- "off": the experts stay MXFP4;
- "on": held dense whatever it costs the KV cache;
- "auto" (`choose_auto`): held dense when the capacity plan with them still fits (the planner's
  criterion, `k3.cache.capacity.FITS_CRITERION`) and its KV cache still holds the fewer of
  max_num_seqs and what it holds without them, in max-length requests (the cache may not cut the
  concurrency the scheduler would reach: k3-slice on an H200 at 8,448 tokens and 64 sequences,
  366 -> 64 requests); where all of them do not, the experts of as many MoE layers as do (the
  first ones: a partial cache, the others staying MXFP4; the ppu experts entry picks its way per
  layer from the weights it is given); else none. Only on a device that reports its memory
  size: the CPU (whose cache is sized by kv_cache_memory_gib) stays off unless "on".
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
    """What the engine does with the routed experts: `on` (held dense) and why, in one sentence;
    `layers` the MoE layers held dense when not all of them (the first ones), else None."""

    mode: str
    on: bool
    reason: str
    layers: int | None = None


def resolve_mode(config, platform) -> str:
    """The requested mode: the engine option, else the platform's default, else "off"."""
    mode = config.expert_cache or platform.config_defaults().get("expert_cache") or "off"
    if mode not in EXPERT_CACHE_MODES:
        raise ValueError(f"expert_cache must be auto, on or off, got {mode!r} (the platform's default "
                         "or --expert-cache)")
    return mode


def largest_fitting_layers(acceptable, total_layers: int) -> int:
    """The most MoE layers (0 to total_layers) whose experts held dense leave an acceptable plan:
    acceptable(n) judges the plan with the first n layers' experts dense. Fewer dense layers
    never need more memory, so a bisection: log2(layers) plans."""
    lo, hi = 0, total_layers                 # lo acceptable (nothing dense: the MXFP4 plan), hi unknown
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if acceptable(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class AutoChoice:
    """What "auto" holds dense: `layers` None (every MoE layer), a count (the first ones) or 0
    (none); `report` the capacity plan it leaves; `floor` the max-length requests that plan must
    still hold; `total` the MoE layers."""

    layers: int | None
    report: object
    floor: int
    total: int


def choose_auto(plan_with_cache, max_num_seqs: int) -> AutoChoice:
    """The expert cache "auto" mode's choice (the engine's and `k3 plan`'s): every layer's experts
    dense when the plan still fits and its KV cache holds `floor` max-length requests, the
    fewer of max_num_seqs and what the plan without the cache holds (the dense experts may not
    cut the concurrency the scheduler would reach); else the most layers for which that holds;
    else none. plan_with_cache(layers=None): the capacity report with the first `layers` MoE
    layers' experts dense (0: none, None: all)."""
    plans = {}                                       # layers -> report: each plan made once

    def plan(layers):
        if layers not in plans:
            plans[layers] = plan_with_cache(layers=layers)
        return plans[layers]

    floor = max(1, min(max_num_seqs, plan(0).concurrent_max_len_requests))

    def acceptable(layers) -> bool:
        report = plan(layers)
        return report.fits and report.concurrent_max_len_requests >= floor

    total = plan(0).weight_terms.expert_layers
    if acceptable(None):
        return AutoChoice(None, plan(None), floor, total)
    layers = largest_fitting_layers(acceptable, total - 1)
    return AutoChoice(layers, plan(layers), floor, total)


def decide(config, cfg, platform, plan_with_cache) -> ExpertCacheDecision:
    """Hold the experts dense? plan_with_cache(layers=None): the engine's capacity report with
    the experts of the first `layers` MoE layers (None: every one, 0: none) counted dense (called
    only for "auto" on a device with a memory size; `choose_auto`)."""
    mode = resolve_mode(config, platform)
    if not cfg.experts_mxfp4:
        return ExpertCacheDecision(mode, False, "the routed experts are not MXFP4")
    if mode != "auto":
        return ExpertCacheDecision(mode, mode == "on", f"expert_cache {mode}")
    if torch.device(platform.info.device).type == "cpu" or not platform.capabilities.memory_bytes:
        return ExpertCacheDecision(mode, False, "auto: the device reports no memory size to plan against; "
                                                "expert_cache on forces it")
    choice = choose_auto(plan_with_cache, config.max_num_seqs)
    r = choice.report
    experts = r.weight_terms.routed_experts / GIB
    holds = (f"the KV cache then holds {r.concurrent_max_len_requests:,} max-length requests "
             f"(at least {choice.floor:,}: max_num_seqs, or what it holds without the cache)")
    if choice.layers is None:
        return ExpertCacheDecision(mode, True, f"auto: {experts:.1f} GiB of dense experts fit; {holds}")
    if choice.layers:
        return ExpertCacheDecision(mode, True, f"auto: the first {choice.layers} of {choice.total} MoE layers' experts "
                                               f"held dense, all {choice.total} would not fit ({experts:.1f} GiB of "
                                               f"routed experts); {holds}", layers=choice.layers)
    return ExpertCacheDecision(mode, False, f"auto: not one MoE layer's dense experts leave a KV cache of "
                                            f"{choice.floor:,} max-length request{'s' * (choice.floor != 1)} "
                                            "(max_num_seqs, or what it holds without them); expert_cache on forces it")


def hold_experts_dense(model, layers: int | None = None) -> int:
    """The first `layers` MoE layers' MXFP4 experts (None: every layer's) held dense
    (`MoE.hold_experts_dense`), a layer at a time,
    each layer's freed planes returned to the device before the next layer's stacks are
    allocated (they are smaller than a stack, so the allocator could not reuse them; the KV
    cache is allocated next). Returns the bytes of the dense stacks."""
    from k3.model.ffn import MoE

    device = next(model.parameters()).device
    module = torch.get_device_module(device) if device.type != "cpu" else None
    held = 0
    for layer in [m for m in model.modules() if isinstance(m, MoE)][:layers]:
        held += layer.hold_experts_dense()
        if module is not None and hasattr(module, "empty_cache"):
            module.empty_cache()
    return held


def apply(config, cfg, platform, model, plan_with_cache) -> ExpertCacheDecision:
    """`decide`, then hold the experts dense when it says so; logs the decision."""
    decision = decide(config, cfg, platform, plan_with_cache)
    if decision.on:
        held = hold_experts_dense(model, decision.layers)
        logger.info(f"expert cache on ({decision.reason}): {held / GIB:.2f} GiB ({held:,} bytes) of routed experts "
                    f"held dense in {model.dtype}")
    elif decision.mode != "off" and cfg.experts_mxfp4:
        logger.info(f"expert cache off ({decision.reason})")
    return decision
