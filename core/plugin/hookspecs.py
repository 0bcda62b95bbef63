"""k3 hook specifications, version 1 (`k3.plugin.HOOKSPEC_VERSION`).

A plugin is a module (or object) registered under the `k3` entry-point group. It declares
`K3_HOOKSPEC_VERSIONS = (1,)` and implements any of these hooks with `@k3.hookimpl`, naming
only the arguments it uses (pluggy passes those; arguments only grow within a version). A
platform plugin's hooks are asked only while its platform is the selected one, so no hook checks
the platform's name; a plugin without a platform (kernels only) is asked on every platform. The
reference plugin implements every hook as `trylast`, so every table resolves. Hooks are
resolved once, when the model is built, into plain callables: the hot path never calls the
plugin manager. The kernel contract (signatures, shapes, dtypes, ownership) is the protocols of
`k3.plugin.kernels` (docs/ops.md).
"""

from __future__ import annotations

from .markers import hookspec

# ------------------------------------------------------------------------------- platform


@hookspec
def k3_detect_platform():
    """Is this plugin's platform present? Called once per process, before selection.

    Returns a `Detection` (name, available, one-sentence reason, forceable, priority, torch
    device), or None for plugins that add kernels but no platform. Must be cheap: no vendor
    SDK import at module level, no device initialisation beyond a presence query.
    """


@hookspec(firstresult=True)
def k3_capabilities(platform):
    """Capabilities of the selected platform's device, read from the device (memory, arch,
    dtypes, fp8 flavour, native MXFP4/NVFP4, graph capture, symmetric memory, HIP IPC...).

    Asked only of the plugin that detected the selected platform. Returns `Capabilities`; the
    reference answers with the CPU's.
    """


@hookspec
def k3_add_cli_options(parser, platform_name):
    """Add vendor options to a `k3 serve` / `k3-serve-<vendor>` argparse group. Every plugin
    may add options; names must start with `--<platform_name>-` to avoid clashes."""


@hookspec
def k3_config_defaults(platform):
    """Vendor defaults for serving options (dict of option name -> value, e.g.
    {"gpu_memory_utilization": 0.85}). Merged in hook order: the first value of a key wins."""


@hookspec
def k3_validate_config(platform, config, options):
    """Problems with serving this model `config` (K3Config) with these `options` on the
    platform, as a list of one-sentence strings (empty: fine). Never raises."""


# ------------------------------------------------------------------------------ the cache


@hookspec(firstresult=True)
def k3_allocate_cache(platform, num_rows, row_bytes, alignment):
    """Allocate the backing tensor of one rank's packed cache for the core planner's plan.

    The planner fixes the row format and stride (every region aligned to `alignment` bytes,
    `row_bytes` a multiple of it); the plugin chooses only where the memory comes from (a
    pool, symmetric or registered memory for peer access...). Returns a uint8 tensor
    [num_rows, row_bytes] on the platform's device whose rows are `row_bytes` apart and whose
    first byte is `alignment`-aligned, every byte 0xFF (NaN in each cache float format, so
    unwritten memory shows), or None to leave it to the next plugin. The reference
    allocates with `torch.full`.
    """


@hookspec(firstresult=True)
def k3_graph_runner(platform):
    """A graph capturer for decode steps (CUDA graphs, HIP graphs...), or None to run every
    step eagerly (the reference).

    Returns an object with `capture(fn) -> (replay, outputs)`: warm `fn` up as the device needs
    (compilation, library handles), record one call of it, and return a no-argument `replay`
    that re-runs the recorded work on the same input and output tensors, plus what the recorded
    call returned. The core calls it once per batch-size bucket, largest first, at start-up, with
    an `fn` that runs the model on static metadata tensors it refills before each replay; `fn`
    never synchronises with the host. Captures may share one memory pool (they never run at
    once). The model cases of the conformance suite check replayed decode against eager decode.
    Optional attributes: `pads_on_host` (a tracing runner: metadata padded on the host) and
    `table_width_buckets` (decode attention costs the block table's width: also capture at
    narrower context bounds, `k3.engine.graphs.context_buckets`).
    """


@hookspec(firstresult=True)
def k3_step_end(platform):
    """A no-argument callable the engine calls after every model forward it runs, or None
    (the reference: an eager backend has nothing to do).

    For a backend that traces lazily (torch-xla): the call cuts the trace there, so the step's
    work (its logits and its cache writes) is compiled and launched as one graph per step
    shape; without it the cache tensors keep the pending trace of every earlier step and each
    later step's graph carries all of them (a new, ever larger program per step). It must not
    wait for the device to finish.
    """


@hookspec(firstresult=True)
def k3_shape_buckets(platform, max_num_seqs, max_num_batched_tokens):
    """Static shapes for a backend that compiles one program per tensor shape (XLA), as a
    `ShapeBuckets` (sequence-count buckets and packed-token buckets), or None: every step runs
    at its own shape (the reference; CUDA and HIP graphs need only `k3_graph_runner`'s batch
    buckets).

    max_num_seqs / max_num_batched_tokens: the engine's limits, which the buckets should cover
    (a step past the largest bucket pads to a multiple of it). The engine pads each step to its
    buckets on the host before the upload (padding sequences on a scratch row, their logits
    dropped, the sampler run at the batch bucket too), captures decode graphs at the batch
    buckets, and pads every block table to the longest sequence's width; the plugin never sees
    a padded row.
    """


@hookspec(firstresult=True)
def k3_kda_state_layout(platform):
    """The order inside a KDA state row this platform's kernels want: "hkv" (canonical
    [H, K, V]) or "hvk" ([H, V, K]: each head transposed). The row's size and place are the
    planner's; only the element order inside it changes. The core addresses the state through
    `KDAStateView.recurrent` in canonical index order either way; a kernel reads
    `KDAStateView.stored()`. None leaves it to the next plugin (the reference: "hkv")."""


# -------------------------------------------------------------------------------- kernels
# Each returns the family's kernel table (`k3.plugin.tables`) with the entries the plugin backs,
# or None. Every entry's signature, shapes, dtypes, outputs and ownership are its protocol's in
# `k3.plugin.kernels` (docs/ops.md); the facade merges the tables entry by entry.
# batch_invariant: True when the engine runs in the batch-invariant mode (`--batch-invariant`):
# return the entries you can claim batch invariant, each marked with `k3.plugin.batch_invariant`
# (unmarked entries are passed over in that mode; the mode is refused when an entry has no
# marked provider). A hook that does not declare the argument is asked as before.


@hookspec
def k3_kda_kernels(platform, batch_invariant):
    """A `KDAKernels` table: gate, short_conv, chunked, recurrent, rebuild_state, decode_step
    (protocols in `k3.plugin.kernels.kda`). States passed as arguments are canonical
    [N, HV, K, V] whatever `k3_kda_state_layout` says; `decode_step` alone updates the cache's
    state rows in place."""


@hookspec
def k3_mla_kernels(platform, batch_invariant):
    """An `MLAKernels` table: prefill, decode (protocols in `k3.plugin.kernels.mla`)."""


@hookspec
def k3_indexer_kernels(platform, batch_invariant):
    """An `IndexerKernels` table: quantize_keys, dequantize_keys, scores, decode_scores,
    paged_decode_scores, topk, hadamard (protocols in `k3.plugin.kernels.indexer`)."""


@hookspec
def k3_moe_kernels(platform, batch_invariant):
    """A `MoEKernels` table: router_logits, select_experts, experts (protocols in
    `k3.plugin.kernels.moe`)."""


@hookspec
def k3_attn_res_kernels(platform, batch_invariant):
    """An `AttnResKernels` table: step, mix (protocols in `k3.plugin.kernels.attn_res`)."""


@hookspec
def k3_elementwise_kernels(platform, batch_invariant):
    """An `ElementwiseKernels` table: rms_norm, gated_rms_norm, layer_norm, l2_norm,
    glu_activation, sigmoid (protocols in `k3.plugin.kernels.elementwise`)."""


@hookspec
def k3_quant_kernels(platform, batch_invariant):
    """A `QuantKernels` table: fp8, MXFP4 and NVFP4 quantize / dequantize, bit-exact with
    `k3.quant` (protocols in `k3.plugin.kernels.quant`)."""


@hookspec
def k3_dense_kernels(platform, batch_invariant):
    """A `DenseKernels` table: linear (protocol in `k3.plugin.kernels.dense`): the graph's weight
    products (every projection, the LM head)."""


@hookspec
def k3_lora_kernels(platform, batch_invariant):
    """A `LoRAKernels` table: delta, experts (protocols in `k3.plugin.kernels.lora`): LoRA
    adapters of multi-adapter batches (docs/lora.md)."""


# ---------------------------------------------------------------------------- collectives


@hookspec
def k3_collective_backends(platform, group):
    """Communication backends for one process group (None: the default group), each a
    `CollectiveBackend` with `accepts(op, tensor)` for op "all_reduce", "all_gather" or
    "all_to_all_single" (expert-parallel dispatch: split sizes as host ints or a device int
    tensor). Returns a list (possibly empty) or None. The facade asks them in plugin order and
    uses the first that accepts and has the op's method; the reference's torch.distributed
    backend comes last and accepts everything."""


# --------------------------------------------------------------------------- quantisation


@hookspec
def k3_process_weights(platform, model):
    """Repack a loaded model's weights in place for this platform's kernels (every plugin is
    called; the reference does nothing). Must leave the model computing the same function."""


# ---------------------------------------------------------------------------- conformance


@hookspec
def k3_conformance_expectations(platform):
    """Path of this plugin's `conformance.toml` (expected failures with reasons), or None."""
