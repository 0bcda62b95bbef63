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
    """KDA kernels: a `KDAKernels` table with the entries the plugin backs, or None.

    gate(f [.., HV, K], A_log [HV], dt_bias, lower_bound) -> g [.., HV, K] fp32 log decay (<= 0);
    short_conv(x [B, T, C], weight [C, W], conv_state [N, C, W-1]) -> (y [B, T, C], state);
    recurrent / chunked(q, k [B, T, H, K] L2-normalised, v [B, T, HV, V], g [B, T, HV, K],
    beta [B, T, HV], initial_state [N, HV, K, V] fp32, cu_seqlens [N+1]) -> (o [B, T, HV, V]
    v.dtype, final_state [N, HV, K, V] fp32, optional per-position states / corrections /
    checkpoint states); rebuild_state(s0, k, g, u [N, L, HV, *], num_kept [N]) -> [N, HV, K, V];
    decode_step(qkv [N, 3HK], conv_weight, f [N, H, K], A_log, dt_bias, b [N, H],
    out_gate [N, H, V], o_norm_weight, recurrent, conv_state (cache views), state_indices [N],
    fresh [N]) -> o [N, H, V]: the fused one-token step, reading and writing the state rows
    in place (the only entry that writes the cache).
    States passed as arguments are canonical [N, HV, K, V] whatever `k3_kda_state_layout` says.
    Outputs are new tensors; the model writes the cache rows."""


@hookspec
def k3_mla_kernels(platform):
    """MLA kernels: an `MLAKernels` table, or None.

    prefill(q [T, H, Dn+Dr], latent [S, R], k_pe [S, Dr], kv_b_weight [H*(Dn+Dv), R],
    cu_seqlens_q, cu_seqlens_kv [N+1], scale, topk_indices [T, k] or None) -> o [T, H, Dv];
    decode(q_nope [T, H, Dn], q_pe [T, H, Dr], kv_cache [P, page, R+Dr] (bf16, or fp8 with
    kv_cache_scale), block_table [N, max_pages] int32, seq_lens [N], w_uk [H, Dn, R],
    w_uv [H, R, Dv], scale, cu_seqlens_q or None, topk_indices or None) -> o [T, H, Dv],
    with no host synchronisation. Reads the cache view, never writes it."""


@hookspec
def k3_indexer_kernels(platform):
    """DSA indexer kernels: an `IndexerKernels` table, or None.

    quantize_keys(k [S, D], fmt) -> fp8: (e4m3 [S, D], fp32 [S]) | mxfp4: (uint8 [S, D/2],
    E8M0 [S, D/32]); dequantize_keys(values, scales, fmt, dtype) -> [S, D];
    scores(q [T, Hi, D], head_weights [T, Hi], keys [S, D], cu_seqlens_q, cu_seqlens_kv) ->
    [T, max_kv] fp32 with -inf outside the causal window; decode_scores(q [N, Hi, D],
    head_weights [N, Hi], keys [N, L, D], seq_lens [N]) -> [N, L] fp32, no host sync;
    paged_decode_scores(q, head_weights, key_values [P, page, ...], key_scales, block_table
    [N, max_pages], seq_lens, fmt) -> [N, max_pages * page]: the same, reading the cache's
    quantised key pages directly (what decode calls);
    topk(scores [T, L], topk) -> int32 [T, topk] (ties to the lower position, -1 padding);
    hadamard(x [..., 2^n]) -> x.dtype."""


@hookspec
def k3_moe_kernels(platform):
    """MoE kernels: a `MoEKernels` table, or None.

    router_logits(h [T, D], weight [E, D]) -> fp32 [T, E]; select_experts(logits, top_k,
    correction_bias [E], scoring, renormalize, ...) -> (topk_weights fp32 [T, k], topk_ids
    int [T, k]); experts(x [T, L],
    w13 [E_local, 2I, L], w2 [E_local, L, I] (dense or MXFP4Tensor), topk_weights, topk_ids,
    activation, beta, linear_beta, expert_start, dense_dispatch) -> x.dtype [T, L], this
    rank's partial sum (experts outside its range contribute nothing); dense_dispatch=True
    must not synchronise with the host (decode, graph capture)."""


@hookspec
def k3_attn_res_kernels(platform):
    """AttnRes kernels: an `AttnResKernels` table, or None.

    step(prefix [T, D], delta [T, D] or None, blocks [T, NB, D], query [D], num_visible_blocks,
    write_index, eps, out_norm_weight, out_eps) -> (h [T, D], prefix [T, D]): the fused prefix
    update, block write (in place into `blocks`, the only argument written), mix and RMSNorm;
    mix(sources [S, T, D], query [D], eps) -> [T, D] in sources.dtype."""


@hookspec
def k3_elementwise_kernels(platform):
    """Norm and activation kernels: an `ElementwiseKernels` table, or None.

    rms_norm(x [.., D], weight [D] or None, eps) (normalise in fp32, cast, then x weight);
    gated_rms_norm(x, gate [.., D], weight [D], eps, activation); layer_norm(x, weight, bias,
    eps); l2_norm(x, eps) (eps inside the sqrt); glu_activation(x [.., 2I], activation, beta,
    linear_beta) -> [.., I]. Each returns x.dtype, computed in fp32."""


@hookspec
def k3_quant_kernels(platform):
    """Codecs for quantised cache pages and weights: a `QuantKernels` table, or None.

    fp8_quantize(x, block_size, scale=None, dtype) -> (fp8 values, fp32 scales per block);
    mxfp4_quantize(x [.., N]) -> (uint8 [.., N/2], E8M0 uint8 [.., N/32]); nvfp4_quantize(x,
    global_scale=None) -> (uint8 [.., N/2], e4m3 scales [.., N/16], fp32 global scale); each *_dequantize(values,
    scales, ..., dtype) inverts it. Bit-exact with the reference codecs (docs/ops.md)."""


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
