"""Which kernels the amd plugin serves: the portable Triton kernels of k3.platforms.triton_kernels
(and the torch fast paths of k3.platforms.torch_kernels) that compile for gfx942 and gfx950
(bench/amdgcn_report.py), each given its target's launch options from archs.py. K3_AMD_DISABLE
(a comma-separated list of the names below, or "all") hands an entry back to the reference op.

Not served on AMD: the MoE `gemv` mode (inline PTX: `fma.rn.f16x2`), 3xTF32 dots ("tf32x3",
NVIDIA's; the chunked KDA prefill and the indexer prefill run IEEE fp32 dots instead) and
fla-core's chunked prefill (experimental on NVIDIA too). Nothing here has executed on AMD
hardware (docs/platforms.md, conformance/reports/amd-simulated-cpu/).

FlyDSL kernels (k3.platforms.amd.fly_kernels: W4A16 MXFP4 experts for decode batches, sparse
MLA decode over bf16 pages) and AITER's fused ops (k3.platforms.amd.aiter_ops) are opt-in:
served only when K3_AMD_FLYDSL=1 / K3_AMD_AITER=1 and they can run (a ROCm device; AITER
importing), in place of the entry of the same kernel-table slot, which keeps every input they
do not cover. They have never executed (the FlyDSL kernels are lowered to AMDGCN in CI only).
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from dataclasses import dataclass

from . import archs

DISABLE_ENV = "K3_AMD_DISABLE"
FLYDSL_ENV = "K3_AMD_FLYDSL"
AITER_ENV = "K3_AMD_AITER"


@dataclass(frozen=True)
class Kernel:
    """One kernel the plugin serves: the kernel-table entry it backs ("family.entry"), the
    function ("module:function" under k3.platforms), what it is, and the modules it needs
    installed (looked up, not imported, until the kernel is served). opt_in: the environment
    variable that must be set ("1") for it to serve (never-executed FlyDSL and AITER paths), in
    place of the entry's default, which it takes as `fallback` for the inputs it does not cover
    (the reference op when none serves)."""

    entry: str
    target: str
    about: str
    needs: tuple[str, ...] = ("triton",)
    opt_in: str | None = None


def _unverified(library: str, entry: str, target: str, about: str) -> Kernel:
    """An opt-in kernel of `library` ("flydsl": K3_AMD_FLYDSL, "aiter": K3_AMD_AITER) that has never executed."""
    return Kernel(entry, target, f"{about} (unverified: never executed)", needs=(library,),
                  opt_in={"flydsl": FLYDSL_ENV, "aiter": AITER_ENV}[library])


SERVED = {
    "kda_decode_step": Kernel("kda.decode_step", "triton_kernels.kda_decode:kda_decode_step",
                              "fused KDA decode step (conv, gates, L2 norms, state update, gated RMSNorm)"),
    "kda_short_conv": Kernel("kda.short_conv", "triton_kernels.short_conv:short_conv",
                             "causal short conv of prefill chunks and verify steps"),
    "kda_recurrent": Kernel("kda.recurrent", "triton_kernels.kda_recurrent:kda_recurrent",
                            "token-serial KDA for speculative verify"),
    "kda_chunked": Kernel("kda.chunked", "triton_kernels.kda_chunked_blocked:kda_chunked",
                          "chunked KDA prefill, both phases in Triton with IEEE fp32 dots"),
    "moe_experts": Kernel("moe.experts", "amd.moe:experts_forward",
                          "MXFP4 routed experts: dot_scaled (native MXFP4 on gfx950) or in-kernel E2M1 decoding"),
    "moe_router": Kernel("moe.select_experts", "triton_kernels.router:select_experts",
                         "expert selection in one launch"),
    "moe_router_logits": Kernel("moe.router_logits", "triton_kernels.router:router_logits",
                                "fp32 router logits of decode batches"),
    "attn_res_step": Kernel("attn_res.step", "triton_kernels.attn_res:attn_res", "fused Block AttnRes step"),
    "mla_decode": Kernel("mla.decode", "triton_kernels.mla_decode:mla_decode",
                         "absorbed MLA decode over paged latents (bf16 matrix-core operands from bf16 / OCP fp8 rows)"),
    "mla_prefill": Kernel("mla.prefill", "torch_kernels.mla_prefill_sdpa:mla_prefill",
                          "MLA prefill on torch's fused attention", needs=()),
    "indexer_decode_scores": Kernel("indexer.paged_decode_scores",
                                    "triton_kernels.indexer_decode:paged_decode_scores",
                                    "DSA indexer decode scores from the fp8 key pages"),
    "indexer_prefill_scores": Kernel("indexer.scores", "triton_kernels.indexer_prefill:indexer_scores",
                                     "DSA indexer prefill scores in one launch"),
    "indexer_topk": Kernel("indexer.topk", "torch_kernels.indexer_topk:indexer_topk",
                           "DSA indexer top-k on torch.topk", needs=()),
    "rms_norm": Kernel("elementwise.rms_norm", "triton_kernels.rms_norm:rms_norm", "K3's RMSNorm in one launch"),
    "glu_activation": Kernel("elementwise.glu_activation", "triton_kernels.glu:glu_activation",
                             "SiTU-GLU / SiLU-GLU of the dense FFNs in one launch"),
    "flydsl_moe_experts": _unverified("flydsl", "moe.experts", "amd.fly_kernels.moe_w4a16:experts_forward",
                                      "FlyDSL W4A16 MXFP4 experts for decode batches"),
    "flydsl_sparse_mla_decode": _unverified("flydsl", "mla.decode", "amd.fly_kernels.sparse_mla:mla_decode",
                                            "FlyDSL sparse (DSA) MLA decode over bf16 pages"),
    "aiter_add_rms_norm": _unverified("aiter", "elementwise.add_rms_norm", "amd.aiter_ops:add_rms_norm",
                                      "AITER's fused add + RMSNorm"),
    "aiter_moe_experts": _unverified("aiter", "moe.experts", "amd.aiter_ops:experts_forward",
                                     "AITER's fused MoE over MXFP4 experts, SiLU-GLU"),
    "aiter_mla_decode": _unverified("aiter", "mla.decode", "amd.aiter_ops:mla_decode",
                                    "AITER's MLA decode over bf16 pages"),
}


def disabled() -> set[str]:
    """The names K3_AMD_DISABLE lists ("all": every one); unknown names warn and are ignored."""
    names = {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    unknown = names - set(SERVED) - {"all"}
    if unknown:
        warnings.warn(f"{DISABLE_ENV}: unknown kernel name(s) {sorted(unknown)} ignored; known: "
                      f"{', '.join(sorted(SERVED))}, or all", stacklevel=3)
    return set(SERVED) if "all" in names else names


def opted_in(env: str) -> bool:
    """Whether the opt-in variable `env` (K3_AMD_FLYDSL, K3_AMD_AITER) is set ("1", "true", "yes", "on")."""
    return os.environ.get(env, "").strip().lower() in ("1", "true", "yes", "on")


def implementation(name: str, target: archs.Arch):
    """The callable served for kernel `name` on `target`: the kernel's function with the
    target's launch options bound (archs.Arch.launch), or the function itself when it has none."""
    kernel = SERVED[name]
    module, function = kernel.target.split(":")
    fn = getattr(importlib.import_module(f"k3.platforms.{module}"), function)
    options = target.launch.get(name)
    if not options:
        return fn
    bound = functools.partial(fn, **options)
    functools.update_wrapper(bound, fn)          # keeps __name__, __module__, __doc__ for reports
    return bound


def table_entries(family: str, target: archs.Arch, has_module) -> dict:
    """entry name -> callable of every served kernel of `family` that is not disabled and whose
    modules are installed (`has_module(name)`); opt-in kernels (their variable set) then replace
    the entry, each with what served it before (or the reference op) bound as its `fallback`."""
    off = disabled()
    entries = {}
    for opt_in in (False, True):
        for name, kernel in SERVED.items():
            kernel_family, entry = kernel.entry.split(".")
            if (bool(kernel.opt_in) != opt_in or kernel_family != family or name in off
                    or (kernel.opt_in and not opted_in(kernel.opt_in))
                    or not all(has_module(m) for m in kernel.needs)):
                continue
            fn = implementation(name, target)
            if opt_in:
                fn = functools.partial(fn, fallback=entries.get(entry) or _reference(kernel.entry))
            entries[entry] = fn
    return entries


def _reference(entry: str):
    """The reference platform's kernel of `entry` ("family.entry"): its pure-torch table's."""
    from k3.platforms.torch_kernels.tables import torch_tables

    family, name = entry.split(".")
    return getattr(torch_tables()[family], name)
