"""`k3 plan`: the packed cache plan and its capacity for a memory budget (every term shown)."""

from __future__ import annotations

import argparse
import json
import sys

from k3.cache.capacity import DEFAULT_GPU_MEMORY_GIB, GIB, CapacityReport, plan_capacity
from k3.dtypes import INDEX_CACHE_DTYPES, KV_CACHE_DTYPES, resolve_kv_cache_dtype

from .common import CliError, add_model_arguments, load_config


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Cache flags shared by `k3 plan` and `k3 serve`."""
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                        help="latent cache dtype (auto: the model dtype)")
    parser.add_argument("--index-cache-dtype", choices=list(INDEX_CACHE_DTYPES), default="fp8",
                        help="DSA index-key cache format (default fp8)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N")
    parser.add_argument("--decode-context-parallel-size", type=int, default=1, metavar="N")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help=f"memory per accelerator (default: the local accelerator's, else {DEFAULT_GPU_MEMORY_GIB:g})")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="N",
                        help="context length to plan for (default: the config's)")
    parser.add_argument("--block-size", type=int, default=None, metavar="N",
                        help="tokens per row, a power of two (default: the smallest whose row holds a KDA state)")
    parser.add_argument("--max-num-seqs", type=int, default=64, metavar="N", help="requests in one batch (default 64)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                        help="tokens in one forward (default 2048)")
    parser.add_argument("--enable-prefix-caching", action="store_true",
                        help="reuse the cache of shared prompt prefixes (resumed only at KDA checkpoints)")
    parser.add_argument("--prefix-match-unit", type=int, default=None, metavar="N",
                        help="prefix caching: tokens per hashed unit, divides the block size (default min(64, block))")
    parser.add_argument("--kda-checkpoint-interval", type=int, default=0, metavar="N",
                        help="prefix caching: also save KDA states every N prompt tokens, a multiple of the unit "
                             "(default 0: at the end of each prompt's last full unit only)")
    parser.add_argument("--speculative-config", metavar="JSON", default=None,
                        help="speculative decoding, vLLM's JSON shape (docs/speculative.md); the plan reserves "
                             "its scratch state rows")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_cache_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")


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
    from k3.engine.spec.config import SpeculativeConfig, SpeculativeConfigError

    kv = resolve_kv_cache_dtype(args.kv_cache_dtype, cfg.dtype)     # `auto`: as the engine resolves it
    memory = int(args.gpu_memory * GIB) if args.gpu_memory is not None else local_gpu_memory_bytes()
    try:
        spec = SpeculativeConfig.parse(args.speculative_config)
    except SpeculativeConfigError as e:
        raise CliError(f"--speculative-config: {e}") from None
    try:
        return plan_capacity(cfg, kv_cache_dtype=kv, index_cache_dtype=args.index_cache_dtype,
                             tensor_parallel_size=args.tensor_parallel_size,
                             decode_context_parallel_size=args.decode_context_parallel_size,
                             gpu_memory_bytes=memory, gpu_memory_utilization=args.gpu_memory_utilization,
                             max_model_len=args.max_model_len, block_size=args.block_size,
                             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                             kda_rollback=spec.kda_rollback if spec else "states",
                             prefix_caching=args.enable_prefix_caching,
                             kda_checkpoint_interval=args.kda_checkpoint_interval, activation_dtype=cfg.dtype)
    except ValueError as e:
        raise CliError(str(e)) from None


def render(r: CapacityReport, family: str) -> str:
    g = lambda n: f"{n / GIB:,.2f} GiB"  # noqa: E731
    lines = [
        f"{family}: TP {r.tensor_parallel_size}, DCP {r.decode_context_parallel_size}, latents {r.kv_cache_dtype}, "
        f"index keys {r.index_cache_dtype}",
        f"  per token per GPU:  {r.bytes_per_token_per_gpu:,} B (latents and index keys, every MLA layer)",
        f"  per request state:  {r.state_bytes_per_request:,} B (KDA recurrent + conv, this rank)",
        f"  block size:         {r.block_size:,} tokens; row {r.row_bytes:,} B "
        f"(padding {r.attention_row_padding:,} B as attention row, {r.state_row_padding:,} B as state row)",
        f"  memory:             {g(r.gpu_memory_bytes)} x {r.gpu_memory_utilization:g} = {g(r.usable_bytes)}",
        f"  - weights per GPU:  {g(r.weight_bytes_per_gpu)}",
        f"  - workspace:        {g(r.workspace_bytes)}",
        f"  = cache:            {g(r.cache_bytes)} = {r.num_rows:,} rows",
        f"  - speculative scratch rows: {r.speculative_scratch_rows:,} (reserved at start-up)",
        f"  max-length request: {r.max_model_len:,} tokens = {r.rows_per_max_len_request - r.state_rows_per_request:,} "
        f"attention rows + {r.state_rows_per_request} state row(s)",
        f"  capacity:           {r.capacity_tokens:,} tokens; {r.concurrent_max_len_requests:,} concurrent "
        f"max-length requests ({r.capacity_tokens / r.max_model_len:,.2f} max lengths)",
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
