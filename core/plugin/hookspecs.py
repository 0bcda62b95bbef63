"""k3 hook specifications, version 1 (`k3.plugin.HOOKSPEC_VERSION`).

A plugin is a module (or object) registered under the `k3` entry-point group. It declares
`K3_HOOKSPEC_VERSIONS = (1,)` and implements any of these hooks with `@k3.hookimpl`. Every
hook receives the selected `platform` (a PlatformInfo) where it matters, so a plugin can
decline (return None) on platforms it does not serve. The reference plugin implements every
hook as `trylast`, so every table resolves. Hooks are resolved once, when the model is built,
into plain callables: the hot path never calls the plugin manager.

Ownership: kernels allocate and return their outputs unless a docstring says they write into
an argument (cache views, the AttnRes block bank); they never keep references to inputs.
Shapes and dtypes of every kernel entry are those of its reference op in docs/ops.md.
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

    Only the plugin that detected `platform` answers; others return None. Returns
    `Capabilities`; the reference answers with the CPU's.
    """


@hookspec
def k3_add_cli_options(parser, platform_name):
    """Add vendor options to a `k3 serve` / `k3-serve-<vendor>` argparse group. Every plugin
    may add options; names must start with `--<platform_name>-` to avoid clashes."""


@hookspec
def k3_config_defaults(platform):
    """Vendor defaults for serving options (dict of option name -> value, e.g.
    {"gpu_memory_utilization": 0.85}). Later plugins do not override earlier ones."""


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
def k3_kda_state_layout(platform):
    """The order inside a KDA state row this platform's kernels want: "hkv" (canonical
    [H, K, V]) or "hvk" ([H, V, K]: each head transposed). The row's size and place are the
    planner's; only the element order inside it changes. The core addresses the state through
    `KDAStateView.recurrent` in canonical index order either way; a kernel reads
    `KDAStateView.stored()`. None leaves it to the next plugin (the reference: "hkv")."""


# -------------------------------------------------------------------------------- kernels


@hookspec
def k3_kda_kernels(platform):
    """KDA kernels: a `KDAKernels` table (gate, short_conv, chunked, recurrent) with the
    entries the plugin backs, or None. States are fp32 `[N, HV, K, V]` (canonical layout)."""


@hookspec
def k3_mla_kernels(platform):
    """MLA kernels: an `MLAKernels` table (prefill: expanded varlen; decode: absorbed over a
    paged latent cache view, `topk_indices` for DSA sparse attention), or None."""


@hookspec
def k3_indexer_kernels(platform):
    """DSA indexer kernels: an `IndexerKernels` table (quantize_keys, dequantize_keys, scores,
    topk, hadamard), or None."""


@hookspec
def k3_moe_kernels(platform):
    """MoE kernels: a `MoEKernels` table (router_logits in fp32, select_experts, experts over
    stacked dense or MXFP4 weights), or None. `experts` returns this rank's partial sum."""


@hookspec
def k3_attn_res_kernels(platform):
    """AttnRes kernels: an `AttnResKernels` table (step: fused prefix update + block write +
    mix + RMSNorm, writing the block bank in place; mix), or None."""


@hookspec
def k3_elementwise_kernels(platform):
    """Norm and activation kernels: an `ElementwiseKernels` table, or None."""


@hookspec
def k3_quant_kernels(platform):
    """Codecs for quantised cache pages and weights (FP8, MXFP4, NVFP4): a `QuantKernels`
    table, or None."""


# ---------------------------------------------------------------------------- collectives


@hookspec
def k3_collective_backends(platform, group):
    """Communication backends for one process group (None: the default group), each a
    `CollectiveBackend` with `accepts(op, tensor)`. Returns a list (possibly empty) or None.
    The facade asks them in plugin order and uses the first that accepts; the reference's
    torch.distributed backend comes last and accepts everything."""


# --------------------------------------------------------------------------- quantisation


@hookspec
def k3_process_weights(platform, model):
    """Repack a loaded model's weights in place for this platform's kernels (every plugin is
    called; the reference does nothing). Must leave the model computing the same function."""


# ---------------------------------------------------------------------------- conformance


@hookspec
def k3_conformance_expectations(platform):
    """Path of this plugin's `conformance.toml` (expected failures with reasons) when it
    serves `platform`, else None."""
