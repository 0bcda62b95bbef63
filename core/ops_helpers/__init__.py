"""k3.ops_helpers: the shape, varlen, mask and input helpers that the reference ops and the
kernels share, public and documented, so a kernel never imports a private reference internal.

Every helper checks the kernel contract's conventions (`k3.plugin.kernels`) the same way the
reference does and raises the same `ValueError`s, so a kernel that starts from one reports bad
inputs exactly as the oracle would. The compute-dtype rule itself is `k3.dtypes`
(`compute_dtype`, `upcast`).

- varlen: `sequence_bounds` (KDA's cu_seqlens), `checkpoint_offsets_per_sequence`,
  `chunk_cuts`, `varlen_spans` (MLA's and the indexer's cu_seqlens_q / cu_seqlens_kv).
- masks: `allowed_mask` (causal and DSA top-k visibility), `masked_softmax`,
  `check_topk_indices`.
- conv_inputs: `ConvInputs`, `check_conv_inputs`, `check_conv_weight`, `check_conv_state` (the
  short conv entry's checks; the last two read nothing on the host).
- kda_inputs: `KDAInputs`, `prepare_kda_inputs` (the KDA entries' checks, then the inputs in
  the compute dtype, heads repeated to the value heads).
- index_query: `index_query` (the indexer's query side, fp8-rounded as DeepSeek-V3.2).
- invariant (a module, `from k3.ops_helpers import invariant`): the batch-invariant kernels'
  constructions (fixed-tree sums, fixed-shape GEMM row blocks, one implementation per
  transcendental function) and the mode's log-probability normaliser.
"""

from .conv_inputs import ConvInputs, check_conv_inputs, check_conv_state, check_conv_weight
from .index_query import index_query
from .kda_inputs import KDAInputs, prepare_kda_inputs
from .masks import allowed_mask, check_topk_indices, masked_softmax
from .varlen import checkpoint_offsets_per_sequence, chunk_cuts, sequence_bounds, varlen_spans

__all__ = ["ConvInputs", "KDAInputs", "allowed_mask", "check_conv_inputs", "check_conv_state",
           "check_conv_weight", "check_topk_indices", "checkpoint_offsets_per_sequence", "chunk_cuts",
           "index_query", "masked_softmax", "prepare_kda_inputs", "sequence_bounds", "varlen_spans"]
