"""The tpu platform's kernel tables: entries that trace into XLA graphs without host reads,
data-dependent shapes or CPU fallbacks (checked on PJRT's CPU device by tests/tpu and
`k3 conformance --platform tpu`).

Today every entry here is plain torch from `k3.platforms.torch_kernels` (or a `k3.reference`
op) chosen for being XLA-clean on the decode path, measured with torch-xla's metrics
(docs/kernel-contract.md, section (a)): no `aten::*` fallback counter, no device-to-host
transfer inside the step. The one entry that differs from the reference platform is
`moe.experts`: always the dense dispatch (every local expert on every token, masked by the
routing weights), because the default dispatch reads the used experts on the host (`unique`,
`nonzero`). Entries left out (KDA chunked prefill, MLA prefill, the indexer's prefill scores)
fall back to the reference plugin's kernels, which read `cu_seqlens` on the host by contract;
XLA prefill kernels of their own are still to come (platforms/tpu/README.md).
"""

from __future__ import annotations

from k3.platforms.torch_kernels import moe_experts
from k3.platforms.torch_kernels.tables import torch_tables
from . import kda_chunked
from k3.plugin.tables import AttnResKernels, ElementwiseKernels, IndexerKernels, KDAKernels, MLAKernels, MoEKernels


def experts_dense(x, w13, w2, topk_weights, topk_ids, *, activation, beta=None, linear_beta=None, expert_start=0,
                  dense_dispatch=True):
    """`Experts` with the dense dispatch always (static shapes, no host read); `dense_dispatch`
    is accepted and ignored: both dispatches compute the same function."""
    return moe_experts.experts_forward(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta,
                                       linear_beta=linear_beta, expert_start=expert_start, dense_dispatch=True)


def _pick(table_type, family: str, entries: tuple[str, ...], **own):
    """A `table_type` with `entries` taken from the pure-torch kernel set, plus `own` entries."""
    base = torch_tables()[family]
    return table_type(**{e: getattr(base, e) for e in entries}, **own)


def kda_table() -> KDAKernels:
    """The KDA decode path (gate, short_conv, recurrent, the fused decode step) and the chunked
    prefill as a fixed-chunk scan (`kda_chunked.py`)."""
    return _pick(KDAKernels, "kda", ("gate", "short_conv", "recurrent", "decode_step"), chunked=kda_chunked.kda_chunked)


def mla_table() -> MLAKernels:
    """The absorbed paged decode (masks by seq_lens: padding sequences of length 0 give zeros)."""
    return _pick(MLAKernels, "mla", ("decode",))


def indexer_table() -> IndexerKernels:
    """DSA decode scores over the paged index keys and exact top-k (torch.topk: static k)."""
    return _pick(IndexerKernels, "indexer", ("paged_decode_scores", "topk"))


def moe_table() -> MoEKernels:
    """Router logits, top-k selection and the dense-dispatch experts."""
    return _pick(MoEKernels, "moe", ("router_logits", "select_experts"), experts=experts_dense)


def attn_res_table() -> AttnResKernels:
    """Block Attention Residuals (plain torch reductions)."""
    return _pick(AttnResKernels, "attn_res", ("step", "mix"))


def elementwise_table() -> ElementwiseKernels:
    """Norms and activations (plain torch)."""
    return _pick(ElementwiseKernels, "elementwise", ("rms_norm", "gated_rms_norm", "layer_norm", "l2_norm",
                                                     "glu_activation"))
