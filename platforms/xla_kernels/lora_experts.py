"""Routed experts with per-expert LoRA adapters for XLA: `LoRAKernels.experts` with the dense
dispatch (every local expert on every token, weighted by its routing weight, 0 where the token
did not choose it), as the tpu plugin's `moe.experts` does.

`k3.plugin.kernels.LoRAExperts` is the contract and `k3.reference.lora_experts_forward` its
oracle, which gathers each expert's tokens with `nonzero` (a data-dependent shape, run on the
CPU by torch-xla). Same products per token, static shapes, no host read.
"""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype
from k3.reference import glu_activation, lora_delta
from k3.reference.moe import _expert


def lora_experts(x, w13, w2, topk_weights, topk_ids, indices, *, w13_lora, w2_lora, scales, activation,
                 beta=None, linear_beta=None, expert_start=0):
    """`LoRAExperts` with the dense dispatch (the module docstring)."""
    t, l = x.shape
    cd = compute_dtype(x, *[w for w in (w13, w2) if isinstance(w, torch.Tensor)])
    out = torch.zeros(t, l, dtype=cd, device=x.device)
    xc = x.to(cd)
    tw = topk_weights.to(cd)
    for e in range(w13.shape[0]):
        weight = torch.where(topk_ids - expert_start == e, tw, 0.0).sum(-1)              # [T], 0: not chosen
        gate_up = xc @ _expert(w13, e, cd).T                                              # [T, 2I]
        for cut, a, b in w13_lora:
            gate_up[:, cut] += lora_delta(xc, a[:, e], b[:, e], scales, indices).to(cd)
        act = glu_activation(gate_up, activation=activation, beta=beta, linear_beta=linear_beta)
        down = act @ _expert(w2, e, cd).T                                                 # [T, L]
        for cut, a, b in w2_lora:
            down[:, cut] += lora_delta(act, a[:, e], b[:, e], scales, indices).to(cd)
        out = out + weight[:, None] * down
    return out.to(x.dtype)
