"""`k3 plan`: the packed cache plan and its capacity for a memory budget and a distributed
topology (every term shown), whether it fits, and the smallest topology that does when not."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from k3.cache.topology import DEFAULT_GPU_MEMORY_GIB, DEFAULT_GPUS_PER_NODE, Topology
from k3.dtype_names import INDEX_CACHE_DTYPES, KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES

from . import values
from .common import CliError, add_model_arguments, load_config

if TYPE_CHECKING:             # torch loads with the capacity model, in run() only
    from k3.cache.capacity import CapacityReport

GIB = 1024 ** 3


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Cache flags shared by `k3 plan` and `k3 serve`."""
    parser.add_argument("--kv-cache-dtype", type=values.kv_cache_dtype, default="auto",
                        metavar="{" + ",".join([*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES]) + "}",
                        help="latent cache dtype (auto: the model dtype; vLLM's bfloat16 / fp8_e4m3 are bf16 / fp8; "
                             "nvfp4: E2M1 latents, E4M3 scales per 16, rope dims in E4M3, as vLLM's nvfp4)")
    parser.add_argument("--index-cache-dtype", choices=list(INDEX_CACHE_DTYPES), default="fp8",
                        help="DSA index-key cache format (default fp8: D + 4 bytes a token; mxfp4: D/2 + D/32)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N")
    parser.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1, metavar="N")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help=f"memory per accelerator (default: the local accelerator's, else {DEFAULT_GPU_MEMORY_GIB:g})")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F")
    parser.add_argument("--max-model-len", type=values.max_model_len, default=None, metavar="N",
                        help="context length to plan for: N, 32k (32,000), 32K (32,768), 1M, or auto (default: "
                             "the config's)")
    parser.add_argument("--block-size", type=int, default=None, metavar="N",
                        help="tokens per row, a power of two (default: the smallest whose row holds a KDA state)")
    parser.add_argument("--max-num-seqs", type=int, default=64, metavar="N", help="requests in one batch (default 64)")
    parser.add_argument("--max-num-batched-tokens", type=values.human_readable_int, default=2048, metavar="N",
                        help="tokens in one forward (default 2048)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse the cache of shared prompt prefixes, resumed at KDA checkpoints (exact; "
                             "default on, as in vLLM, except with --decode-context-parallel-size > 1)")
    parser.add_argument("--prefix-match-unit", type=int, default=None, metavar="N",
                        help="prefix caching: tokens per hashed unit, divides the block size (default min(64, block))")
    parser.add_argument("--kda-checkpoint-interval", type=int, default=0, metavar="N",
                        help="prefix caching: also save KDA states every N prompt tokens, a multiple of the unit "
                             "(default 0: at the end of each prompt's last full unit only)")
    parser.add_argument("--expert-cache", choices=["auto", "on", "off"], default=None,
                        help="hold MXFP4 routed experts dequantised in the model dtype (read at 2 bytes a weight by "
                             "kernels without an MXFP4 path; the cache is planned after them): auto: when the plan "
                             "still fits with them; serving's default: the platform's (ppu: auto, else off)")
    parser.add_argument("--speculative-config", "-sc", metavar="JSON", default=None,
                        help="speculative decoding, vLLM's JSON shape (docs/speculative.md); the plan reserves "
                             "its scratch state rows")


def add_topology_arguments(parser: argparse.ArgumentParser) -> None:
    """Distributed-topology flags beside add_cache_arguments' --tensor-parallel-size (vLLM's
    spelling; `k3.cache.topology` states what each shards). `topology_from_args` checks them."""
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                        help="engines, each with the whole model (experts aside) and its own cache (default 1)")
    parser.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                        help="split the routed experts over TP x DP ranks instead of TP")
    parser.add_argument("--expert-parallel-size", type=int, default=None, metavar="N",
                        help="expert-parallel size, a divisor of TP x DP (implies --enable-expert-parallel; "
                             "default TP x DP)")
    parser.add_argument("--nnodes", type=int, default=None, metavar="N",
                        help="nodes (default: TP x DP / --gpus-per-node)")
    parser.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                        help=f"GPUs per node (default min(TP x DP, {DEFAULT_GPUS_PER_NODE}))")


def resolve_prefix_caching(args: argparse.Namespace) -> bool:
    """--enable-prefix-caching as a bool (in place): on unless --no-enable-prefix-caching, or
    left out with --decode-context-parallel-size > 1 or --token-sharded-prefill-min-tokens
    (which do not run with it yet)."""
    if args.enable_prefix_caching is None:
        args.enable_prefix_caching = (args.decode_context_parallel_size <= 1
                                      and not getattr(args, "token_sharded_prefill_min_tokens", 0))
    return args.enable_prefix_caching


def topology_from_args(args: argparse.Namespace) -> Topology:
    """The topology of add_cache_arguments' and add_topology_arguments' flags; CliError names
    the wrong flag."""
    try:
        return Topology.build(args.tensor_parallel_size, args.data_parallel_size,
                              enable_expert_parallel=args.enable_expert_parallel,
                              expert_parallel_size=args.expert_parallel_size, nnodes=args.nnodes,
                              gpus_per_node=args.gpus_per_node)
    except ValueError as e:
        raise CliError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_cache_arguments(parser)
    add_topology_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")


def resolve_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    resolve_prefix_caching(args)


def local_gpu_memory_bytes() -> int:
    """The selected platform's accelerator memory, or the default when it reports none."""
    from k3.platform import PlatformError, select_platform

    try:
        platform = select_platform()
    except PlatformError:
        return int(DEFAULT_GPU_MEMORY_GIB * GIB)
    memory = platform.capabilities.memory_bytes
    return memory if memory and platform.name != "reference" else int(DEFAULT_GPU_MEMORY_GIB * GIB)


def report_for(args: argparse.Namespace, cfg) -> CapacityReport:
    from k3.cache.capacity import plan_capacity
    from k3.dtypes import resolve_kv_cache_dtype
    from k3.engine.spec.config import SpeculativeConfig, SpeculativeConfigError

    topology = topology_from_args(args)
    kv = resolve_kv_cache_dtype(args.kv_cache_dtype, cfg.dtype)     # `auto`: as the engine resolves it
    memory = int(args.gpu_memory * GIB) if args.gpu_memory is not None else local_gpu_memory_bytes()
    try:
        spec = SpeculativeConfig.parse(args.speculative_config)
    except SpeculativeConfigError as e:
        raise CliError(f"--speculative-config: {e}") from None
    def plan(expert_cache: bool, layers: int | None = None, suggest: bool = True) -> CapacityReport:
        return plan_capacity(cfg, kv_cache_dtype=kv, index_cache_dtype=args.index_cache_dtype,
                             tensor_parallel_size=topology.tensor_parallel_size,
                             data_parallel_size=topology.data_parallel_size,
                             expert_parallel_size=topology.expert_parallel_size, nnodes=topology.nnodes,
                             gpus_per_node=args.gpus_per_node,
                             decode_context_parallel_size=args.decode_context_parallel_size,
                             gpu_memory_bytes=memory, gpu_memory_utilization=args.gpu_memory_utilization,
                             max_model_len=args.max_model_len, block_size=args.block_size,
                             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                             kda_rollback=spec.kda_rollback if spec else "states",
                             prefix_caching=resolve_prefix_caching(args),
                             kda_checkpoint_interval=args.kda_checkpoint_interval, activation_dtype=cfg.dtype,
                             expert_cache=expert_cache, expert_cache_layers=layers, suggest=suggest)

    mode = getattr(args, "expert_cache", None) or "off"
    try:
        if mode == "auto" and cfg.experts_mxfp4:      # as the engine decides it (k3.engine.expert_cache)
            from k3.engine.expert_cache import choose_auto

            # the probes skip the topology search a plan that does not fit runs; the chosen plan has it
            # (layers 0 is the plan without the cache)
            choice = choose_auto(lambda layers=None: plan(True, layers, suggest=False), args.max_num_seqs)
            return plan(True, choice.layers)
        return plan(mode == "on")
    except ValueError as e:
        raise CliError(str(e)) from None


def suggestion_line(suggested: dict | None) -> str:
    """'--tensor-parallel-size 8 --data-parallel-size 4 --enable-expert-parallel (32 GPUs, 4 nodes of 8)'."""
    if suggested is None:
        return "none up to the search limit fits (more memory per GPU, or a shorter --max-model-len)"
    t = Topology(tensor_parallel_size=suggested["tensor_parallel_size"],
                 data_parallel_size=suggested["data_parallel_size"],
                 expert_parallel_size=suggested["expert_parallel_size"], nnodes=suggested["nnodes"],
                 gpus_per_node=suggested["gpus_per_node"])
    return f"{' '.join(t.flags(nodes=False))} ({t.describe()})"


def verdict(r: CapacityReport) -> str:
    """'fits' or 'does not fit: WHY; smallest fitting topology: FLAGS (N GPUs, ...)'."""
    if r.fits:
        return "fits"
    g = lambda n: f"{n / GIB:,.2f} GiB"  # noqa: E731
    need = r.weight_bytes_per_gpu + r.workspace_bytes
    if need > r.usable_bytes:
        why = (f"{g(r.weight_bytes_per_gpu)} of weights per GPU + {g(r.workspace_bytes)} workspace exceed the "
               f"usable {g(r.usable_bytes)}")
    else:
        why = (f"a {r.max_model_len:,}-token request needs {r.rows_per_max_len_request:,} rows, the cache holds "
               f"{max(0, r.num_rows - r.speculative_scratch_rows):,}")
    return f"does not fit: {why}; smallest fitting topology: {suggestion_line(r.suggested)}"


def render(r: CapacityReport, family: str) -> str:
    g = lambda n: f"{n / GIB:,.2f} GiB"  # noqa: E731
    w = r.weight_terms
    ep = (f"EP {r.expert_parallel_size}" if r.expert_parallel_size is not None else "EP off")
    lines = [
        f"{family}: TP {r.tensor_parallel_size}, DP {r.data_parallel_size}, {ep}, DCP "
        f"{r.decode_context_parallel_size} ({r.topology.describe()}), latents {r.kv_cache_dtype}, "
        f"index keys {r.index_cache_dtype}",
        f"  per token per GPU:  {r.bytes_per_token_per_gpu:,} B (latents and index keys, every MLA layer)",
        f"  per request state:  {r.state_bytes_per_request:,} B (KDA recurrent + conv, this rank)",
        f"  block size:         {r.block_size:,} tokens; row {r.row_bytes:,} B "
        f"(padding {r.attention_row_padding:,} B as attention row, {r.state_row_padding:,} B as state row)",
        f"  memory:             {g(r.gpu_memory_bytes)} x {r.gpu_memory_utilization:g} = {g(r.usable_bytes)}",
        f"  - weights per GPU:  {g(r.weight_bytes_per_gpu)}",
        f"      attention:            {g(w.attention)} (KDA, MLA + absorbed decode weights, any DSA indexer; heads "
        f"sharded over TP {r.tensor_parallel_size})",
        f"      routed experts:       {g(w.routed_experts)} ({w.experts_per_rank:,} experts per GPU"
        + ((" held dense, the expert cache, " if r.expert_cache_layers == w.expert_layers else
            f" held dense in the first {r.expert_cache_layers} of {w.expert_layers} MoE layers, the expert cache, ")
           if r.expert_cache else ", ")
        + (f"split over EP {r.expert_parallel_size})" if r.expert_parallel_size is not None
           else f"split over TP {r.tensor_parallel_size}, replicated over DP)"),
        f"      shared experts/dense: {g(w.shared_dense)} (sharded over TP)",
        f"      embedding + lm_head:  {g(w.embedding_lm_head)} (vocabulary sharded over TP)",
        f"      other:                {g(w.other)} (router, latent down/up projections, norms, AttnRes; replicated)",
        f"  - workspace:        {g(r.workspace_bytes)}",
        f"  = cache:            {g(r.cache_bytes)} = {r.num_rows:,} rows",
        f"  - speculative scratch rows: {r.speculative_scratch_rows:,} (reserved at start-up)",
        f"  max-length request: {r.max_model_len:,} tokens = {r.rows_per_max_len_request - r.state_rows_per_request:,} "
        f"attention rows + {r.state_rows_per_request} state row(s)",
        f"  capacity:           {r.capacity_tokens:,} tokens per engine; {r.concurrent_max_len_requests:,} concurrent "
        f"max-length requests ({r.capacity_tokens / r.max_model_len:,.2f} max lengths)",
        f"  capacity total:     {r.capacity_tokens_total:,} tokens (x DP {r.data_parallel_size}, one cache per engine)",
        f"  {verdict(r)}",
        f"  (fits: {r.fits_criterion})",
    ]
    lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    report = report_for(args, cfg)
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(report, cfg.family))
    return 0
