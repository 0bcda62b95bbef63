"""What the nvidia plugin serves in the batch-invariant mode (docs/batch-invariance.md): every
entry marked, from two sources.

Its own Triton kernels that are batch invariant by construction: one program per row (token),
every launch option fixed by the model's dimensions (never by the batch), the row's reductions
in the program's fixed order, no atomics, ties to the lower index:
  - elementwise.rms_norm: one program a row, BLOCK_D and warps from D;
  - elementwise.glu_activation: elementwise, one program per (row, column block);
  - attn_res.step: one program a token, its column step pinned (`ATTN_RES_STEP`: the served
    kernel picks it by batch size, so here it is fixed);
  - moe.select_experts: one program a token, top-k by repeated arg-max (ties to the lower id).
Each serves the inputs its kernel covers; the others (which the kernel would hand to the
reference op, whose CUDA reductions are not batch invariant) go to the torch kernel below.

For every other entry the batch-invariant torch kernels (`k3.platforms.torch_kernels.invariant`)
on the GPU: elementwise operations and fixed-tree sums run the same code for every element
there, and each dense product is a fixed-shape [32, in] x [in, out] cuBLAS GEMM, bitwise
reproducible for its shape on one GPU model (cuBLAS's documented guarantee for one stream).
Kernels not claimed here (the MXFP4 experts and MLA decode pick tiles and splits by batch size,
the router logits switch kernels at 4 tokens, torch.topk breaks ties by no fixed rule) are not
served in the mode. Unverified on a GPU until `bench/batch_invariant_h200.sh` passes there.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

from k3.platforms.torch_kernels.invariant import invariant_tables
from k3.plugin import batch_invariant as mark

from . import experimental

ATTN_RES_STEP = (1024, 4)           # (columns a step, warps) of attn_res.step in the mode


def _kernel(module: str):
    return importlib.import_module(f"k3.platforms.triton_kernels.{module}")


def rms_norm(x, weight, eps):
    """`RMSNorm`: the Triton kernel where it covers x, else the invariant torch kernel."""
    kernel = _kernel("rms_norm")
    if kernel.covers(x, weight):
        return kernel.rms_norm(x, weight, eps)
    return invariant_tables()["elementwise"].rms_norm(x, weight, eps)


def glu_activation(x, *, activation, beta=None, linear_beta=None):
    """`GLUActivation`: the Triton kernel where it covers x, else the invariant torch kernel."""
    kernel = _kernel("glu")
    valid = activation != "situ" or (beta is not None and beta > 0 and (linear_beta is None or linear_beta > 0))
    fn = kernel.glu_activation if kernel.covers(x, activation) and valid else \
        invariant_tables()["elementwise"].glu_activation
    return fn(x, activation=activation, beta=beta, linear_beta=linear_beta)


def attn_res_step(prefix, delta, blocks, *, query, num_visible_blocks, write_index, eps, out_norm_weight, out_eps):
    """`AttnResStep`: the Triton kernel with its column step pinned, else the invariant torch kernel."""
    kernel = _kernel("attn_res")
    kw = dict(query=query, num_visible_blocks=num_visible_blocks, write_index=write_index, eps=eps,
              out_norm_weight=out_norm_weight, out_eps=out_eps)
    if kernel.covers(prefix, delta, blocks):
        return kernel.attn_res(prefix, delta, blocks, **kw, block_d=ATTN_RES_STEP[0], num_warps=ATTN_RES_STEP[1])
    return invariant_tables()["attn_res"].step(prefix, delta, blocks, **kw)


def select_experts(logits, *, top_k, correction_bias=None, scoring="sigmoid", renormalize=True,
                   routed_scaling_factor=1.0, num_expert_group=1, topk_group=1):
    """`SelectExperts`: the Triton kernel where it covers the call, else the invariant torch kernel."""
    kernel = _kernel("router")
    kw = dict(top_k=top_k, correction_bias=correction_bias, scoring=scoring, renormalize=renormalize,
              routed_scaling_factor=routed_scaling_factor, num_expert_group=num_expert_group, topk_group=topk_group)
    if kernel.covers(logits, num_expert_group) and scoring in ("sigmoid", "softmax") and 1 <= top_k <= logits.shape[1]:
        return kernel.select_experts(logits, **kw)
    return invariant_tables()["moe"].select_experts(logits, **kw)


# entry -> (this module's wrapper, the promoted kernel whose switch (K3_NVIDIA_DISABLE) it follows)
OWN = {
    "elementwise.rms_norm": (rms_norm, "rms_norm"),
    "elementwise.glu_activation": (glu_activation, "glu_activation"),
    "attn_res.step": (attn_res_step, "attn_res_step"),
    "moe.select_experts": (select_experts, "moe_router"),
}


@functools.cache
def _triton_installed() -> bool:
    from k3.platforms._probe import has_module

    return has_module("triton")


def _own(family: str, entry: str):
    """This plugin's kernel for the entry in the mode, or None (OWN's, switched on, Triton installed)."""
    own = OWN.get(f"{family}.{entry}")
    return own[0] if own is not None and _triton_installed() and experimental.enabled(own[1]) else None


def table(family: str):
    """The mode's table of `family`: every entry marked batch invariant, this plugin's own kernel
    where `_own` gives one, the torch one otherwise."""
    base = invariant_tables()[family]
    return dataclasses.replace(base, **{e: mark(_own(family, e) or getattr(base, e)) for e in base.provided()})


def served() -> dict[str, str]:
    """"family.entry" -> what serves it in the mode: "nvidia triton" or "torch invariant"."""
    return {f"{family}.{e}": "nvidia triton" if _own(family, e) else "torch invariant"
            for family, base in invariant_tables().items() for e in base.provided()}
