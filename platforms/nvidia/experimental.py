"""Which Triton kernels the nvidia platform serves: the promoted set (each passed the
conformance suite on the H200, conformance/reports/nvidia-h200/) by default, minus any named in
K3_NVIDIA_DISABLE (a comma-separated list, or "all": the reference op serves that entry
instead, for bisecting a wrong output); plus the experimental kernels, written but not served
until named in K3_NVIDIA_EXPERIMENTAL (a list, or "all"), so a developer can run
`K3_NVIDIA_EXPERIMENTAL=all k3 conformance --platform nvidia` and the benchmarks on a GPU
before promoting one (promotion needs a passing device report).
"""

from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import dataclass

from k3.platforms._probe import has_module

ENV = "K3_NVIDIA_EXPERIMENTAL"
DISABLE_ENV = "K3_NVIDIA_DISABLE"


@dataclass(frozen=True)
class Kernel:
    """One kernel the plugin can serve: the kernel-table entry it backs ("family.entry"), the
    function ("module:function" under k3.platforms), what it is, and the modules it needs
    installed (looked up, not imported, until the kernel is served)."""

    entry: str
    target: str
    about: str
    needs: tuple[str, ...] = ("triton",)

    def function(self):
        """The kernel's callable: `target` imported (its module may import what `needs` names)."""
        module, function = self.target.split(":")
        return getattr(importlib.import_module(f"k3.platforms.{module}"), function)


PROMOTED = {
    "kda_decode_step": Kernel("kda.decode_step", "triton_kernels.kda_decode:kda_decode_step",
                              "fused KDA decode step (conv, gates, L2 norms, state update, gated RMSNorm)"),
    "kda_short_conv": Kernel("kda.short_conv", "triton_kernels.short_conv:short_conv",
                             "causal short conv of prefill chunks and verify steps, ragged, with checkpoint windows"),
    "moe_experts": Kernel("moe.experts", "triton_kernels.moe_mxfp4:experts_forward",
                          "MXFP4 routed experts, W4A16, SiTU-GLU fused"),
    # two for moe.experts: the later one serves unless K3_NVIDIA_DISABLE names it. moe_experts_bf16 (issue 27):
    # 16-1,023-token bf16 batches on decode_bf16 tiles over the experts repacked tile-major
    # (plugin.k3_process_weights), 1.5x the 16- and 64-request decode throughput of k3-slice on an H100
    # (BENCHMARKS.md, 2026-12-06); moe and model conformance passed there with the experts repacked in place
    "moe_experts_bf16": Kernel("moe.experts", "triton_kernels.moe_mxfp4:experts_forward_bf16_decode",
                               "MXFP4 routed experts repacked tile-major, the codes decoded to bf16 pairs in the "
                               "registers (PTX) for bf16 tensor-core tiles from 16 tokens up to the prefill dequant "
                               "mode"),
    "moe_router": Kernel("moe.select_experts", "triton_kernels.router:select_experts",
                         "expert selection (scores, bias, top-k, renormalisation) in one launch"),
    "moe_router_logits": Kernel("moe.router_logits", "triton_kernels.router:router_logits",
                                "fp32 router logits of decode batches up to 4 tokens in one launch (fp32 FMAs)"),
    "attn_res_step": Kernel("attn_res.step", "triton_kernels.attn_res:attn_res", "fused Block AttnRes step"),
    "mla_decode": Kernel("mla.decode", "triton_kernels.mla_decode:mla_decode_native",
                         "absorbed MLA decode over paged latents, split-K flash decoding on bf16 tensor cores "
                         "from bf16 / fp8 rows, the splits merged in one launch"),
    "mla_prefill": Kernel("mla.prefill", "torch_kernels.mla_prefill_sdpa:mla_prefill",
                          "MLA prefill on torch's fused attention (flash / memory-efficient kernels)", needs=()),
    "kda_recurrent": Kernel("kda.recurrent", "triton_kernels.kda_recurrent:kda_recurrent",
                            "token-serial KDA for speculative verify: per-position states and corrections"),
    "indexer_decode_scores": Kernel("indexer.paged_decode_scores", "triton_kernels.indexer_decode:paged_decode_scores",
                                    "DSA indexer decode scores read from the fp8 or MXFP4 key pages through the "
                                    "block table"),
    "indexer_prefill_scores": Kernel("indexer.scores", "triton_kernels.indexer_prefill:indexer_scores",
                                     "DSA indexer prefill scores over the packed batch in one launch"),
    "rms_norm": Kernel("elementwise.rms_norm", "triton_kernels.rms_norm:rms_norm",
                       "K3's RMSNorm (fp32 inside, rounded as the reference) in one launch"),
    "glu_activation": Kernel("elementwise.glu_activation", "triton_kernels.glu:glu_activation",
                             "SiTU-GLU / SiLU-GLU of the dense FFNs (shared experts) in one launch"),
    "indexer_topk": Kernel("indexer.topk", "torch_kernels.indexer_topk:indexer_topk",
                           "DSA indexer top-k on torch.topk (radix select) instead of a full stable sort", needs=()),
    # two for kda.chunked: the later one whose modules are installed serves
    "kda_chunked_torch": Kernel("kda.chunked", "torch_kernels.kda_chunked_blocked:kda_chunked",
                                "chunked KDA prefill in torch, every chunk's intra-chunk work batched (exact fp32)",
                                needs=()),
    "kda_chunked_blocked": Kernel("kda.chunked", "triton_kernels.kda_chunked_blocked:kda_chunked",
                                  "chunked KDA prefill with both phases in Triton: the intra-chunk phase in "
                                  "exact fp32, the recurrence on 3xTF32 tensor cores"),
    # LoRA (issue 31): conformance's lora cases passed on the H100 (2026-12-05, 15 of 15,
    # bench/results/conformance-lora-triton-h100-2026-12-05.json); served only when LoRA is enabled
    "lora_delta": Kernel("lora.delta", "triton_kernels.lora:lora_delta",
                         "LoRA delta as grouped (SGMV-style) shrink / expand over per-slot row tiles"),
    "lora_experts": Kernel("lora.experts", "triton_kernels.lora:lora_experts_forward",
                           "MXFP4 routed experts with per-expert LoRA: the expert tiles with each pair's adapter "
                           "rows added before the activation and the routing weight"),
}
KERNELS = {
    # fla-core's kda.chunked, when named, serves instead of the promoted kda_chunked_torch
    "kda_chunked": Kernel("kda.chunked", "triton_kernels.kda_chunked:kda_chunked",
                          "chunked KDA prefill with checkpoints over fla-core's chunk_kda (needs fla-core)",
                          needs=("triton", "fla")),
    # the MXFP4 experts with decode batches of 2-64 tokens on the grouped gemv (issue 27), when named
    "moe_experts_grouped": Kernel("moe.experts", "triton_kernels.moe_mxfp4:experts_forward_grouped",
                                  "MXFP4 routed experts with each weight tile decoded once for the 2-64 decode "
                                  "tokens routed to its expert (gemv_grouped)"),
    "kda_chunked_tf32x3": Kernel("kda.chunked", "triton_kernels.kda_chunked_blocked:kda_chunked_tf32x3",
                                 "kda_chunked_blocked with 3xTF32 tensor-core dots in both phases"),
    # issue 27 item 2: phase 1 as whole-chunk 3xTF32 tensor-core dots (kda_intra_chunk's "mma" form)
    "kda_chunked_mma": Kernel("kda.chunked", "triton_kernels.kda_chunked_blocked:kda_chunked_mma",
                              "kda_chunked_blocked with the intra-chunk phase's 64 x 64 products, block inverse "
                              "and W, U as whole-chunk 3xTF32 tensor-core dots"),
    # issue 27 item 2: the prefill's phases split into launches with wide grids (kda_intra_split,
    # kda_chunked_state), each phase alone and both together
    "kda_chunked_split": Kernel("kda.chunked", "triton_kernels.kda_chunked_blocked:kda_chunked_split",
                                "kda_chunked_blocked with the intra-chunk phase in three launches with wide grids "
                                "(A's block rows, the solve, W and U; the wide dots in 3xTF32)"),
    "kda_chunked_state_split": Kernel("kda.chunked", "triton_kernels.kda_chunked_blocked:kda_chunked_state_split",
                                      "kda_chunked_blocked with the recurrence split: a state kernel with two "
                                      "3xTF32 dots a chunk, then the output product in a parallel launch"),
    "kda_chunked_splits": Kernel("kda.chunked", "triton_kernels.kda_chunked_blocked:kda_chunked_splits",
                                 "kda_chunked_blocked with both phases split (kda_chunked_split and "
                                 "kda_chunked_state_split together)"),
}

ALL = {**PROMOTED, **KERNELS}


def _names(env: str, known: dict) -> set[str]:
    names = {n.strip() for n in os.environ.get(env, "").split(",") if n.strip()}
    unknown = names - set(known) - {"all"}
    if unknown:
        warnings.warn(f"{env}: unknown kernel name(s) {sorted(unknown)} ignored; known: "
                      f"{', '.join(sorted(known))}, or all", stacklevel=3)
    return names


def serving(entry: str) -> str | None:
    """The name of the kernel that serves kernel-table entry `entry` ("family.entry"): of those
    switched on (`enabled`) whose modules are installed, the last in PROMOTED then KERNELS (an
    experimental one named replaces the promoted); None where the reference op serves."""
    names = [name for name, kernel in ALL.items()
             if kernel.entry == entry and enabled(name) and all(has_module(m) for m in kernel.needs)]
    return names[-1] if names else None


def enabled(name: str) -> bool:
    """True when kernel `name` serves: a promoted one unless K3_NVIDIA_DISABLE names it, an
    experimental one (a key of KERNELS) only when K3_NVIDIA_EXPERIMENTAL names it."""
    if name in PROMOTED:
        disabled = _names(DISABLE_ENV, PROMOTED)
        return name not in disabled and "all" not in disabled
    assert name in KERNELS, name
    names = _names(ENV, KERNELS)
    return name in names or "all" in names
