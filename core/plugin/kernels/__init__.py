"""The typed kernel protocols: one `typing.Protocol` per kernel-table entry, the only place the
kernel contract is written down (docs/ops.md is generated from it: `python -m k3.reference.ops_doc`).

A kernel entry has exactly its protocol's signature: the same parameter names, kinds and
defaults; a kernel may add keyword-only options with defaults (launch parameters), never change
these. An entry with more than one output returns a frozen dataclass of named outputs
(`KDAChunkedOut(o, state, checkpoints)`), never a tuple whose length depends on flags.

Conventions of every entry:

- Shapes: `T` packed tokens, `N` sequences, `B` batch, `H` heads, `HV` value heads, `K` / `V`
  KDA key / value head dims, `R` MLA latent rank, `Dn` / `Dr` / `Dv` MLA nope / pe / value head
  dims, `E` experts, `L` expert (latent) width, `I` FFN width.
- Dtypes: an entry computes in the compute dtype of its inputs: fp32 for bf16 / fp16 / fp32
  inputs (as kernels accumulate them), fp64 when any input is float64 (the oracle's dtype).
  Outputs are cast back to the activation dtype unless the protocol says otherwise; recurrent
  states stay in the compute dtype. Options are keyword-only. Bad shapes raise `ValueError`
  naming the argument and the shape expected.
- Ownership: outputs are newly allocated; an entry writes only the arguments its protocol
  names (the AttnRes block bank, the state rows of `kda.decode_step`), never keeps a reference
  to an input after it returns, and in decode-path entries never reads a device value on the
  host (docs/kernel-contract.md).
- Varlen: KDA entries take fla-core's layout (with `cu_seqlens` `[N+1]` the batch is B = 1
  and N sequences are packed along T); MLA and indexer entries take `cu_seqlens_q` and
  `cu_seqlens_kv` (the rule is `k3.plugin.kernels.mla`'s). Entries that read `cu_seqlens` on
  the host say so.
"""

from .attn_res import AttnResMix, AttnResOut, AttnResStep
from .dense import Linear
from .elementwise import AddRMSNorm, GatedRMSNorm, GLUActivation, L2Norm, LayerNorm, NormedResidual, RMSNorm, Sigmoid
from .indexer import (
    HadamardTransform,
    IndexerDecodeScores,
    IndexerDequantizeKeys,
    IndexerPagedDecodeScores,
    IndexerQuantizeKeys,
    IndexerScores,
    IndexerTopK,
    QuantizedKeys,
)
from .kda import (
    KDAChunked,
    KDAChunkedOut,
    KDADecodeStep,
    KDAGate,
    KDARebuildState,
    KDARecurrent,
    KDARecurrentOut,
    ShortConv,
    ShortConvOut,
)
from .lora import LoRADelta, LoRAExperts
from .mla import MLADecode, MLAPrefill
from .moe import Experts, ExpertSelection, RouterLogits, SelectExperts
from .quant import FP8Dequantize, FP8Quantize, MXFP4Dequantize, MXFP4Quantize, NVFP4Dequantize, NVFP4Quantize

__all__ = [
    "AttnResMix", "AttnResOut", "AttnResStep", "ExpertSelection", "Experts", "FP8Dequantize", "FP8Quantize",
    "AddRMSNorm", "GLUActivation", "GatedRMSNorm", "HadamardTransform", "IndexerDecodeScores", "IndexerDequantizeKeys",
    "IndexerPagedDecodeScores", "IndexerQuantizeKeys", "IndexerScores", "IndexerTopK", "KDAChunked",
    "KDAChunkedOut", "KDADecodeStep", "KDAGate", "KDARebuildState", "KDARecurrent", "KDARecurrentOut",
    "L2Norm", "LayerNorm", "Linear", "LoRADelta", "LoRAExperts", "MLADecode", "MLAPrefill", "MXFP4Dequantize", "MXFP4Quantize", "NVFP4Dequantize",
    "NVFP4Quantize", "NormedResidual", "QuantizedKeys", "RMSNorm", "RouterLogits", "SelectExperts", "ShortConv", "ShortConvOut", "Sigmoid",
]
