"""Pure-torch reference ops: the naive, obviously correct oracle every kernel is checked against.

Each op is written the plain way (the KDA recurrence token by token, attention as an explicit
masked softmax, the Hadamard transform as a matrix product), runs on any torch device and
computes in the dtype it is given, with half precision computed in fp32 (`k3.dtypes`); float64
inputs make it the kernel oracle. Each kernel entry's contract is its protocol in
`k3.plugin.kernels` (docs/ops.md); nothing here is written for speed: the reference platform
serves the torch kernels of `k3.platforms.torch_kernels`, and conformance checks those against
these ops. Helpers kernels share with the reference are `k3.ops_helpers`.
"""

from ..quant.fp8 import fp8_dequantize, fp8_quantize
from ..quant.mxfp4 import MXFP4Tensor, mxfp4_dequantize, mxfp4_quantize
from ..quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from ..quant.nvfp4_latent import nvfp4_latent_dequantize, nvfp4_latent_quantize
from .activations import glu_activation, sigmoid, silu_glu, situ, situ_glu
from .attn_res import attn_res, attn_res_mix, fold_attn_res_query
from .conv import short_conv
from .dense import linear
from .hadamard import hadamard_transform
from .indexer import (
    index_key_record_bytes,
    indexer_decode_scores,
    indexer_paged_decode_scores,
    indexer_dequantize_keys,
    indexer_quantize_keys,
    indexer_scores,
    indexer_topk,
    pack_index_key_page,
    unpack_index_key_page,
)
from .kda import kda_chunked, kda_gate, kda_rebuild_state, kda_recurrent
from .kda_decode import kda_decode_step
from .lora import lora_delta, lora_experts_forward
from .mla import mla_absorb_weights, mla_decode, mla_expand_kv, mla_prefill
from .moe import experts_forward, glu_mlp, latent_moe, latent_moe_finish, latent_moe_routed_partial
from .norms import add_rms_norm, gated_rms_norm, l2_norm, layer_norm, rms_norm
from .router import router_logits, select_experts
from .sampling import filtered_logits, sample, sampling_probs

__all__ = [
    "MXFP4Tensor", "add_rms_norm", "attn_res", "attn_res_mix", "experts_forward", "filtered_logits", "fold_attn_res_query",
    "fp8_dequantize", "fp8_quantize", "gated_rms_norm", "glu_activation", "glu_mlp", "hadamard_transform",
    "index_key_record_bytes", "indexer_decode_scores", "indexer_dequantize_keys", "indexer_paged_decode_scores",
    "indexer_quantize_keys",
    "indexer_scores",
    "indexer_topk", "kda_chunked", "kda_decode_step", "kda_gate", "kda_rebuild_state", "kda_recurrent", "l2_norm", "latent_moe", "linear", "lora_delta", "lora_experts_forward",
    "latent_moe_finish",
    "latent_moe_routed_partial", "layer_norm", "mla_absorb_weights", "mla_decode", "mla_expand_kv",
    "mla_prefill", "mxfp4_dequantize", "mxfp4_quantize", "nvfp4_dequantize", "nvfp4_quantize",
    "nvfp4_latent_dequantize", "nvfp4_latent_quantize",
    "pack_index_key_page", "rms_norm", "router_logits", "sample", "sampling_probs", "select_experts",
    "short_conv", "sigmoid", "silu_glu", "situ", "situ_glu", "unpack_index_key_page",
]
