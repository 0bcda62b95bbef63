"""`k3 serve`: the OpenAI-compatible server (k3.serve) on one checkpoint.

Flags follow vLLM's where they mean the same. Options the user leaves out take the selected
platform's defaults (`Platform.config_defaults()`), then k3's. Every startup problem (no
checkpoint, platform unavailable, an option k3 does not implement yet, port in use) is one
line on stderr and exit code 2. When the server listens, stderr gets one line:
`k3: serving NAME on http://HOST:PORT`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

from k3.dtype_names import DTYPE_ALIASES, DTYPE_NAMES
from k3.log import get_logger

from . import values
from .common import CliError, add_hub_arguments, fail, resolve_model_dir
from .exposure import exposure_warning, listen_host
from .plan import add_cache_arguments, resolve_prefix_caching
from .vllm_flags import REFUSED

logger = get_logger(__name__)

# --dtype: "auto" (the checkpoint's), k3's dtype names and vLLM's aliases for them
DTYPES = {"auto": "auto", **{name: name for name in DTYPE_NAMES}, **DTYPE_ALIASES}
# environment variables --api-key defaults to (each holds one key; both are accepted when both are set)
API_KEY_ENV = ("K3_API_KEY", "VLLM_API_KEY")


class Default:
    """A flag's built-in default, told apart from a value the user typed (platform defaults
    replace only these)."""

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint directory or Hugging Face repo id (org/name, from the hub cache; as "
                             "`vllm serve MODEL`; or --model)")
    parser.add_argument("--model", default=None, metavar="DIR", help="checkpoint directory or hub repo id (or the "
                                                                     "positional MODEL)")
    add_hub_arguments(parser)
    parser.add_argument("--host", default=None,
                        help="address to listen on (default: all interfaces, as vLLM; a warning when that, or "
                             "any address beyond loopback, is served without --api-key; 127.0.0.1: this machine "
                             "only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="name(s) clients pass as `model` (default: the model as given); the first is reported")
    parser.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                        help="require `Authorization: Bearer KEY` (any of the keys given) on /v1 routes and the "
                             "API docs pages (default: $K3_API_KEY and $VLLM_API_KEY, those set)")
    parser.add_argument("--public-docs", action="store_true",
                        help="with --api-key, leave /docs and /openapi.json open without the key")
    parser.add_argument("--platform", default=None, help="force a platform (default: $K3_PLATFORM, else detection)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="auto",
                        help="activation dtype (auto: the checkpoint's)")
    parser.add_argument("--load-format", choices=["auto", "safetensors", "fastsafetensors", "dummy"], default="auto",
                        help="auto / safetensors: read the checkpoint; fastsafetensors (vLLM's): read as "
                             "safetensors, with a warning; dummy: random weights drawn on the device "
                             "(benchmarks; --model still gives config.json and the tokenizer); vLLM's other "
                             "formats are refused")
    parser.add_argument("--seed", type=int, default=0, help="seeds the draws of requests without a seed")
    parser.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                        help="cache size on the CPU (default: min(2 GiB, RAM / 8)); accelerators size the cache "
                             "from --gpu-memory-utilization")
    add_cache_arguments(parser)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="never capture decode steps as graphs (platforms that capture: nvidia)")
    parser.add_argument("--precompile-context-bounds", action="store_true",
                        help="capture (on tpu: compile) every decode context bound of every batch bucket at "
                             "startup instead of the wider ones on first use, so serving never stalls on a capture "
                             "(platforms whose decode reads the whole block table: ppu, tpu; startup takes one "
                             "capture per bucket and bound)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="launch each decode step before the host has read the previous one's tokens, "
                             "overlapping scheduling and output processing with the device (vLLM's "
                             "--async-scheduling; tensor parallel size 1, no speculative decoding; default: on "
                             "where decode steps are captured as graphs without speculation, off elsewhere)")
    parser.add_argument("--cudagraph-capture-sizes", "--graph-batch-sizes", "--cuda-graph-sizes",
                        dest="graph_batch_sizes", type=int, nargs="+", default=None, metavar="N",
                        help="batch sizes whose decode step is captured (vLLM's spelling; --graph-batch-sizes and "
                             "vLLM's older --cuda-graph-sizes are the same flag; default 1, 2, 4, then multiples "
                             "of 8 up to --max-num-seqs); larger batches run eagerly")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="parse tool calls of requests with tools (needs --tool-call-parser)")
    parser.add_argument("--tool-call-parser", choices=["kimi_k3"], default=None, help="tool call parser")
    parser.add_argument("--reasoning-parser", choices=["kimi_k3"], default=None,
                        help="split the think channel into reasoning_content")
    parser.add_argument("--structured-outputs-config", type=values.json_object, default=None, metavar="JSON",
                        help='the grammar backend, vLLM\'s JSON: {"backend": "xgrammar"} (also "auto", the '
                             'default) or {"backend": "guidance"} (llguidance; "llguidance" is accepted too); '
                             "docs/serving.md#structured-outputs")
    parser.add_argument("--guided-decoding-backend", default=None, metavar="NAME",
                        help="vLLM's older spelling of --structured-outputs-config's backend")
    parser.add_argument("--generation-config", default="auto", metavar="{auto,vllm,DIR}",
                        help="request defaults (temperature, top_p, top_k, min_p, repetition_penalty): auto: "
                             "from the checkpoint's generation_config.json; DIR: from DIR/generation_config.json; "
                             "vllm: none")
    parser.add_argument("--override-generation-config", type=values.json_object, default=None, metavar="JSON",
                        help='request defaults over --generation-config\'s, e.g. \'{"temperature": 0.6}\' (with '
                             '--generation-config vllm: only these)')
    parser.add_argument("--hf-overrides", type=values.json_object, default=None, metavar="JSON",
                        help="fields merged into the checkpoint's config.json before it is read (nested objects "
                             'merge key by key), e.g. \'{"max_position_embeddings": 65536}\'')
    parser.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                        help="a Jinja chat template (a file, or the template itself) that renders chat prompts "
                             "instead of the model's own format (default: the model's; docs/serving.md)")
    parser.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                        help="accepted for vLLM command lines when it names the checkpoint's own "
                             "quantization_config.quant_method (k3 serves the checkpoint's format; another is refused)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for vLLM command lines; k3 never runs code from a checkpoint")
    parser.add_argument("--max-request-body-bytes", type=int, default=16 << 20, metavar="N",
                        help="largest request body accepted (default 16 MiB, a 1M-token prompt as text or ids); "
                             "larger ones get 413 before they are parsed")
    parser.add_argument("--max-prompts-per-request", type=int, default=64, metavar="N",
                        help="prompts one /v1/completions request may batch (default 64; more: 400)")
    parser.add_argument("--max-prompt-tokens-per-request", type=int, default=None, metavar="N",
                        help="prompt tokens one request may bring in all its prompts (default: the context limit, "
                             "--max-model-len; more: 400)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                        help="on SIGTERM / Ctrl-C: stop admitting (503), give running requests up to S seconds, then "
                             "end the rest with finish_reason 'abort' (default 30; a second signal stops at once)")
    parser.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=False,
                        help="log one line per request: its id, prompt count and tokens, the sampling parameters "
                             "that differ from their defaults; never the prompt text unless --max-log-len says "
                             "(default off; k3's log level: $K3_LOGGING_LEVEL)")
    parser.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                        help="no request log lines (the default; vLLM's older spelling)")
    parser.add_argument("--max-log-len", type=int, default=0, metavar="N",
                        help="with --enable-log-requests, also log the first N characters of each request's "
                             "(first) prompt (default 0: never the prompt text)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level (default info: the access log)")
    group = parser.add_argument_group("distributed serving (docs/distributed.md)")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                       help="DP ranks, each with its own scheduler and cache (data-parallel attention); the server on "
                            "rank 0 sends each request to the least-loaded one. World = DP x TP processes (default 1)")
    group.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                       help="split the routed experts over all DP x TP ranks instead of holding all of them on every "
                            "DP rank; idle DP ranks join each step's MoE collectives with an empty batch; no "
                            "speculative decoding or async scheduling with it (docs/expert-parallel.md)")
    group.add_argument("--expert-parallel-size", type=int, default=None, metavar="N",
                       help="ranks each expert group splits the experts over (k3 extra; implies "
                            "--enable-expert-parallel; default the world size; a multiple of TP that divides the world "
                            "and num_experts; the experts are replicated over world / N groups)")
    group.add_argument("--nnodes", type=int, default=1, metavar="N",
                       help="nodes the DP x TP ranks are spread over, evenly (default 1); run one `k3 serve` per node "
                            "with the same flags and its --node-rank")
    group.add_argument("--node-rank", type=int, default=0, metavar="R",
                       help="this node (default 0); node 0 runs global rank 0 and the only API server, the others "
                            "run their ranks and no server")
    group.add_argument("--master-addr", default="127.0.0.1", metavar="ADDR",
                       help="node 0's address for the env:// rendezvous (default 127.0.0.1)")
    group.add_argument("--master-port", type=int, default=None, metavar="PORT",
                       help="rendezvous port on node 0 (default: a free one; several nodes need it)")
    group.add_argument("--token-sharded-prefill-min-tokens", type=int, default=0, metavar="N",
                       help="under --tensor-parallel-size 2, 4 or 8: a fresh prompt chunk of at least N tokens "
                            "gets a step of its own and its MLA attention is split over the TP ranks by tokens "
                            "(docs/token-sharded-prefill.md; default 0: off)")
    group.add_argument("--distributed-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="timeout of every collective: a rank that died or hangs ends the deployment after at most "
                            "this long (default 600). Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) "
                            "each process joins as $RANK and only rank 0 serves HTTP")
    group = parser.add_argument_group("images (docs/vision.md)")
    group.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="chat image_url parts may name local files under DIR (default: data: URLs only)")
    group.add_argument("--allow-remote-media", action="store_true",
                       help="fetch http(s) image_url parts (default: refused with a 400; vLLM fetches them "
                            "unasked)")
    group.add_argument("--max-num-encoder-tokens", type=values.positive_int, default=None, metavar="N",
                       help="image tokens the vision encoder may encode in one step (default: the larger of "
                            "--max-num-batched-tokens and the largest image's tokens)")
    group.add_argument("--mm-encoder-tp-mode", choices=["weights", "data"], default="weights",
                       help="with tensor parallelism: 'weights' shards the vision tower's heads and MLP "
                            "columns over the TP ranks (vLLM's default; 'data' when they do not divide); "
                            "'data' splits each step's images over the ranks (each holds the whole tower) "
                            "and gathers the outputs")
    group.add_argument("--mm-processor-cache-gb", type=values.non_negative_float, default=4.0, metavar="GIB",
                       help="GiB of preprocessed images (patches) kept by content hash: an image seen again "
                            "skips resizing and patchifying (vLLM's processor cache; 0: off)")
    group.add_argument("--limit-mm-per-prompt", type=values.limit_mm_per_prompt, default=None, metavar="JSON",
                       help='vLLM\'s shape, \'{"image": N}\': at most N images a request (0: text only, no '
                            'tower loaded)')
    group = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    group.add_argument("--enable-lora", action="store_true",
                       help="serve PEFT LoRA adapters beside the base model (the `model` field selects one; "
                            "/v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time)")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="adapters loaded at start-up: name=path or vLLM's JSON "
                            "'{\"name\": ..., \"path\": ...}' (needs --enable-lora)")
    group.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                       help="the largest adapter rank accepted (default 16; K3 adapters go up to 32)")
    group.add_argument("--max-loras", type=int, default=1, metavar="N",
                       help="adapters resident at once, the slots a batch may mix (default 1)")
    group = parser.add_argument_group("batch invariance (docs/batch-invariance.md)")
    group.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                       help="a token's log-probs bit-identical whatever shares its batch, however its prompt is "
                            "chunked or preempted, and in decode or a prefill recompute (vLLM's "
                            "VLLM_BATCH_INVARIANT=1); batch-invariant kernels only, decode and prefill through the "
                            "same entries (refused on a platform without them); default $K3_BATCH_INVARIANT")
    group = parser.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    group.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                       help='vLLM\'s shape: \'{"kv_connector": "MooncakeConnector" | "TCPConnector", "kv_role": '
                            '"kv_producer" | "kv_consumer" | "kv_both", "kv_ip": ..., "kv_port": ..., '
                            '"kv_connector_extra_config": {...}}\'; put k3-pd-proxy in front of the instances')
    parser.refused_options = REFUSED          # vLLM flags k3 does not implement: answered with the reason
    for action in parser._actions:
        action.help = SERVE_HELP.get(action.dest, action.help)
        if action.dest in PLATFORM_TUNABLE:  # let platform defaults tell unset options from set ones
            action.default = Default(action.default)


# Help of the shared cache flags where serving reads them differently from `k3 plan`.
SERVE_HELP = {
    "max_model_len": "context limit, prompt + output: N, 32k (32,000), 32K (32,768), 1M, or auto (the default: the "
                     "smaller of the config's and what the cache holds)",
    "gpu_memory": "a `k3 plan` option: refused (the server reads the accelerator's memory)",
    "decode_context_parallel_size": "DCP ranks inside each TP group: each stores every N-th token's MLA latents "
                                    "and index keys (N divides --tensor-parallel-size; docs/context-parallel.md)",
    "tensor_parallel_size": "TP ranks per DP rank, one process each (default 1)",
    "gpu_memory_utilization": "fraction of accelerator memory for weights + cache (default 0.9)",
}


# Options a platform's config_defaults() may set (by dest name).
PLATFORM_TUNABLE = ("dtype", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "kv_cache_dtype",
                    "index_cache_dtype", "gpu_memory_utilization", "max_model_len", "block_size",
                    "tensor_parallel_size")


def apply_defaults(args: argparse.Namespace, platform_defaults: dict) -> None:
    """Unset options take the platform's default, else k3's (in place)."""
    for name in PLATFORM_TUNABLE:
        value = getattr(args, name, None)
        if isinstance(value, Default):
            setattr(args, name, platform_defaults.get(name, value.value))


def resolve_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> None:
    """Resolve what the flags leave to k3 (in place): the model (positional MODEL or --model),
    prefix caching's default, the API keys' environment default. Without both MODEL and
    --model it is a usage error (parser.error; CliError without a parser)."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        _usage_error(parser, f"the model is given twice: MODEL {tag!r} and --model {args.model!r}")
    args.model = args.model if args.model is not None else tag
    if args.model is None:
        _usage_error(parser, "a model is required: k3 serve MODEL (or --model DIR)")
    if getattr(args, "batch_invariant", False) is None:
        args.batch_invariant = os.environ.get("K3_BATCH_INVARIANT", "0") not in ("", "0")
    resolve_prefix_caching(args)
    # vLLM flags k3 reads differently: warned about, then resolved, so a second call is silent
    if getattr(args, "load_format", None) == "fastsafetensors":
        logger.warning(FASTSAFETENSORS_NOTE)
        args.load_format = "safetensors"
    if getattr(args, "trust_remote_code", False):
        logger.warning(TRUST_REMOTE_CODE_NOTE)
        args.trust_remote_code = False           # read nowhere: k3 never runs checkpoint code
    if args.api_key is None:
        keys = [os.environ[name] for name in API_KEY_ENV if os.environ.get(name)]
        args.api_key = keys or None


FASTSAFETENSORS_NOTE = ("--load-format fastsafetensors: k3 reads the checkpoint with its own safetensors loader "
                        "(the same tensors; no GPU-direct file reads)")


TRUST_REMOTE_CODE_NOTE = "--trust-remote-code changes nothing: k3 never runs code from a checkpoint"


def _usage_error(parser, message: str):
    if parser is not None:
        parser.error(message)
    raise CliError(message)


def lora_modules(values: list[str] | None) -> dict[str, str] | None:
    """--lora-modules values (name=path, or vLLM's JSON {"name", "path"}) -> {name: path}."""
    if not values:
        return None
    import json

    out: dict[str, str] = {}
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
                name, path = item["name"], item["path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CliError(f"--lora-modules: {value!r} is not JSON with \"name\" and \"path\"") from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise CliError(f"--lora-modules: {value!r} is not name=path")
        if name in out:
            raise CliError(f"--lora-modules: the name {name!r} is given twice")
        out[name] = path
    return out


def _structured_outputs_backend(args: argparse.Namespace) -> str:
    """The grammar backend --structured-outputs-config / --guided-decoding-backend name."""
    from k3.structured.config import StructuredOutputsConfigError, parse_structured_outputs_config

    try:
        return parse_structured_outputs_config(args.structured_outputs_config, args.guided_decoding_backend)
    except StructuredOutputsConfigError as e:
        raise CliError(str(e)) from None


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse what is not implemented or inconsistent before anything loads."""
    if args.lora_modules and not args.enable_lora:
        raise CliError("--lora-modules needs --enable-lora")
    lora_modules(args.lora_modules)
    if not args.enable_prefix_caching and (args.prefix_match_unit is not None or args.kda_checkpoint_interval):
        raise CliError("--prefix-match-unit and --kda-checkpoint-interval need prefix caching (leave out "
                       "--no-enable-prefix-caching)")
    if args.speculative_config:
        from k3.engine.spec.config import SpeculativeConfig, SpeculativeConfigError

        try:
            SpeculativeConfig.parse(args.speculative_config)
        except SpeculativeConfigError as e:
            raise CliError(f"--speculative-config: {e}") from None
    _structured_outputs_backend(args)
    if args.kv_transfer_config is not None:
        from k3.engine.kv_transfer.config import KVTransferConfig, KVTransferConfigError

        try:
            KVTransferConfig.parse(args.kv_transfer_config)
        except KVTransferConfigError as e:
            raise CliError(str(e)) from None
    dcp, tp = args.decode_context_parallel_size, args.tensor_parallel_size
    if isinstance(tp, Default):
        tp = tp.value                    # k3's default (a platform's is checked again by EngineConfig)
    if dcp < 1 or tp % dcp:
        raise CliError(f"--decode-context-parallel-size {dcp} must divide --tensor-parallel-size {tp} (the DCP "
                       "ranks lie inside a TP group)")
    if args.gpu_memory is not None:
        raise CliError("--gpu-memory is a `k3 plan` option; k3 serve reads the accelerator's memory "
                       "(use --gpu-memory-utilization)")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise CliError("--enable-auto-tool-choice needs --tool-call-parser kimi_k3")
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in [0, 65535], got {args.port}")
    for flag, value in (("--tensor-parallel-size", args.tensor_parallel_size), ("--max-num-seqs", args.max_num_seqs),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens),
                        ("--data-parallel-size", args.data_parallel_size), ("--nnodes", args.nnodes),
                        ("--max-request-body-bytes", args.max_request_body_bytes),
                        ("--max-prompts-per-request", args.max_prompts_per_request),
                        ("--max-prompt-tokens-per-request", args.max_prompt_tokens_per_request)):
        if isinstance(value, int) and value < 1:
            raise CliError(f"{flag} must be at least 1, got {value}")
    if args.max_log_len < 0:
        raise CliError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    if args.shutdown_timeout < 0:
        raise CliError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout:g}")
    if args.api_key is not None and not all(args.api_key):
        raise CliError("--api-key is empty")
    if args.allowed_local_media_path is not None and not Path(args.allowed_local_media_path).is_dir():
        raise CliError(f"--allowed-local-media-path {args.allowed_local_media_path} is not a directory")
    resolve_model_dir(args)
    if args.generation_config not in ("auto", "vllm") and not Path(args.generation_config).is_dir():
        raise CliError(f"--generation-config {args.generation_config}: expected auto, vllm or a directory "
                       "(holding generation_config.json)")


def _listen(host: str, port: int) -> socket.socket:
    """A bound socket (bound before the model loads, so a busy port fails fast)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _startup_errors():
    from k3.checkpoint.loader import CheckpointError
    from k3.config import ConfigError
    from k3.engine.distributed import DistributedError
    from k3.platform import PlatformError

    return PlatformError, ConfigError, CheckpointError, OSError, ValueError, NotImplementedError, DistributedError


def distributed_config(args: argparse.Namespace, config):
    """The DistributedConfig of the flags."""
    from k3.engine.tensor_parallel import distributed_config as from_engine

    return from_engine(config, nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                       master_port=args.master_port)


def is_distributed(args: argparse.Namespace) -> bool:
    from k3.engine.distributed.config import torchrun_rank

    return (args.tensor_parallel_size * args.data_parallel_size > 1 or args.nnodes > 1
            or torchrun_rank() is not None)


def build_engine(args: argparse.Namespace):
    """The engine for the flags (platform defaults applied): an LLMEngine, or with several
    ranks rank 0's DistributedEngine (the other ranks launched); CliError when it cannot start."""
    from k3.engine.engine import LLMEngine

    try:
        config, platform = engine_config(args)
        if is_distributed(args):
            from k3.engine.distributed.launch import start_rank0

            return start_rank0(config, distributed_config(args, config), exit_on_failure=True)
        return LLMEngine(config, platform=platform)
    except _startup_errors() as e:
        raise CliError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def engine_config(args: argparse.Namespace):
    """(EngineConfig, platform) for the flags, platform defaults applied (PlatformError,
    ConfigError, CliError, ...)."""
    from k3.config import K3Config
    from k3.engine.engine import EngineConfig
    from k3.platform import select_platform

    resolve_arguments(args)
    platform = select_platform(args.platform, batch_invariant=args.batch_invariant)
    apply_defaults(args, platform.config_defaults())
    config = EngineConfig(
        model=str(args.model), platform=platform.name, dtype=DTYPES[args.dtype],
        tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel, expert_parallel_size=args.expert_parallel_size,
        decode_context_parallel_size=args.decode_context_parallel_size,
        token_sharded_prefill_min_tokens=args.token_sharded_prefill_min_tokens, distributed_timeout=args.distributed_timeout, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype, index_cache_dtype=args.index_cache_dtype,
        kv_cache_memory_gib=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        expert_cache=getattr(args, "expert_cache", None),
        seed=args.seed, enable_prefix_caching=args.enable_prefix_caching,
        prefix_match_unit=args.prefix_match_unit, kda_checkpoint_interval=args.kda_checkpoint_interval,
        speculative_config=args.speculative_config, enforce_eager=args.enforce_eager, load_format=args.load_format,
        async_scheduling=args.async_scheduling, kv_transfer_config=args.kv_transfer_config,
        graph_batch_sizes=tuple(args.graph_batch_sizes) if args.graph_batch_sizes else None,
        precompile_context_bounds=args.precompile_context_bounds, hf_overrides=args.hf_overrides,
        enable_lora=args.enable_lora, lora_modules=lora_modules(args.lora_modules),
        max_lora_rank=args.max_lora_rank, max_loras=args.max_loras, batch_invariant=args.batch_invariant,
        max_num_encoder_tokens=args.max_num_encoder_tokens, mm_encoder_tp_mode=args.mm_encoder_tp_mode,
        mm_processor_cache_gb=args.mm_processor_cache_gb,
        limit_mm_per_prompt=args.limit_mm_per_prompt, structured_outputs_backend=_structured_outputs_backend(args))
    model_config = K3Config.from_pretrained(args.model, args.hf_overrides)
    _check_quantization(args.quantization, model_config)
    problems = platform.validate_config(model_config, vars(args))
    if problems:
        raise CliError(f"platform {platform.name}: {'; '.join(problems)}")
    if platform.info.forced:
        print(f"k3: platform {platform.name} was not detected; running its forced path on {platform.info.device}",
              file=sys.stderr)
    return config, platform


def _check_quantization(method: str | None, model_config) -> None:
    """--quantization must name the checkpoint's own format (k3 does not quantise at load)."""
    if method is None:
        return
    norm = lambda m: m.lower().replace("_", "-")  # noqa: E731
    have = model_config.quantization.quant_method if model_config.quantization is not None else None
    if have is None or norm(method) != norm(have):
        raise CliError(f"--quantization {method}: k3 serves the checkpoint's own format ("
                       f"{'quant_method ' + repr(have) if have else 'not quantized'}) and does not quantize at "
                       "load; leave --quantization out")


def chat_template(args: argparse.Namespace):
    """The JinjaChatTemplate of --chat-template (None without it); CliError when it cannot be
    read or compiled."""
    if args.chat_template is None:
        return None
    from k3.chat.jinja_template import JinjaChatTemplate, JinjaTemplateError

    try:
        return JinjaChatTemplate(args.chat_template)
    except (JinjaTemplateError, OSError) as e:
        raise CliError(f"--chat-template: {e}") from None


def sampling_defaults(args: argparse.Namespace) -> dict | None:
    """The request defaults of --generation-config (auto: the checkpoint's
    generation_config.json, DIR: DIR's, vllm: none) with --override-generation-config over
    them; None when there are none."""
    from k3.serve import generation_defaults

    source = {"auto": args.model, "vllm": None}.get(args.generation_config, args.generation_config)
    try:
        defaults = generation_defaults(source, overrides=args.override_generation_config)
    except ValueError as e:
        raise CliError(f"--override-generation-config: {e}") from None
    return defaults or None


def run_without_server(args: argparse.Namespace) -> int | None:
    """Processes that serve no HTTP: a node with --node-rank > 0 (its agent: start its ranks,
    wait) or a non-zero rank under torchrun. None for the process that serves."""
    from k3.engine.distributed.config import torchrun_rank

    started = torchrun_rank()
    if not (args.node_rank > 0 or (started is not None and started[0] != 0)):
        return None
    try:
        config, _ = engine_config(args)
        dcfg = distributed_config(args, config)
        if started is not None:
            from dataclasses import replace

            from k3.engine.distributed.launch import check, run_rank

            dcfg = replace(dcfg, master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]))
            check(config, dcfg)
            if started[1] != dcfg.world_size:
                raise CliError(f"torchrun started {started[1]} processes, but --data-parallel-size x "
                               f"--tensor-parallel-size is {dcfg.world_size}")
            return run_rank(config, dcfg, started[0])
        from k3.engine.distributed.launch import run_node

        return run_node(config, dcfg)
    except _startup_errors() as e:
        raise CliError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def _uvicorn_server(app, log_level: str, *, gate=None, engine=None, shutdown_timeout: float = 0.0):
    """A uvicorn server that stops gracefully on SIGINT / SIGTERM and then returns, so the
    engine (and tensor-parallel workers) shut down, instead of re-raising the signal.

    With a `k3.serve.drain.DrainGate` in front of the app, the first signal drains first
    (`k3.serve.drain.drain`: no new requests, running ones get up to shutdown_timeout seconds,
    the rest end with finish_reason "abort") and only then stops the HTTP server; a second
    signal stops at once."""
    import uvicorn

    from k3.serve.drain import drain

    class Server(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        draining = False

        def handle_exit(self, sig, frame) -> None:
            if gate is not None and self.loop is not None and self.started and not self.draining:
                self.draining = True
                print(f"k3: {signal.Signals(sig).name}: draining (up to {shutdown_timeout:g} s for running requests; "
                      "send it again to stop at once)", file=sys.stderr, flush=True)
                self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain_then_exit()))
                return
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()

        async def _drain_then_exit(self) -> None:
            try:
                await drain(gate, engine, shutdown_timeout)
            finally:
                self.should_exit = True

    return Server(uvicorn.Config(gate if gate is not None else app, log_level=log_level, lifespan="off",
                                 timeout_graceful_shutdown=5))


def run(args: argparse.Namespace) -> int:
    from k3.engine.async_engine import AsyncEngine
    from k3.engine.startup_report import log_startup_report
    from k3.serve import build_app
    from k3.serve.media import MediaOptions

    resolve_arguments(args)
    _check_flags(args)
    defaults = sampling_defaults(args)          # a bad override or template fails before the model loads
    template = chat_template(args)
    code = run_without_server(args)
    if code is not None:
        return code
    sock = _listen(listen_host(args.host), args.port)
    async_engine = None
    try:
        engine = build_engine(args)
        log_startup_report(engine)
        warning = exposure_warning(args.host, args.api_key)   # once, when the server is about to start
        if warning:
            logger.warning(warning)
        async_engine = AsyncEngine(engine)
        names = args.served_model_name or [getattr(args, "model_id", None) or args.model]
        try:
            app = build_app(async_engine, served_model_name=names, api_key=args.api_key,
                            enable_auto_tool_choice=args.enable_auto_tool_choice,
                            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                            sampling_defaults=defaults, max_prompts_per_request=args.max_prompts_per_request,
                            max_prompt_tokens_per_request=args.max_prompt_tokens_per_request,
                            public_docs=args.public_docs, chat_template=template,
                            log_requests=args.log_requests, max_log_len=args.max_log_len,
                            media=MediaOptions(allowed_local_media_path=args.allowed_local_media_path,
                                               allow_remote_media=args.allow_remote_media))
        except ValueError as e:
            raise CliError(str(e)) from None
        from k3.serve.drain import DrainGate
        from k3.serve.limits import BodyLimit

        try:
            limited = BodyLimit(app, args.max_request_body_bytes)
        except ValueError as e:
            raise CliError(f"--max-request-body-bytes: {e}") from None
        server = _uvicorn_server(app, args.uvicorn_log_level, gate=DrainGate(limited), engine=async_engine,
                                 shutdown_timeout=args.shutdown_timeout)
        host, port = sock.getsockname()[:2]
        url_host = f"[{host}]" if ":" in host else host

        async def serve() -> None:
            server.loop = asyncio.get_running_loop()
            task = asyncio.ensure_future(server.serve(sockets=[sock]))
            while not server.started and not task.done():
                await asyncio.sleep(0.02)
            if server.started:
                print(f"k3: serving {names[0]} on http://{url_host}:{port}", file=sys.stderr, flush=True)
            await task
            if not server.started:
                raise CliError("the HTTP server did not start (see the log above)")

        try:
            asyncio.run(serve())
        except KeyboardInterrupt:
            pass
        return 0
    finally:
        sock.close()
        if async_engine is not None:
            async_engine.shutdown()


def vendor_main(vendor: str, argv: list[str] | None = None) -> int:
    """`k3-serve-<vendor>`: `k3 serve --platform <vendor>` with that vendor's defaults; exit 2
    with the platform's one-sentence reason when it cannot run here. `--force` serves a
    forceable platform that is not detected here (the PPU's torch-native path on the CPU or
    another CUDA device) instead of refusing."""
    from k3.platform import PlatformError, select_platform

    argv = list(sys.argv[1:] if argv is None else argv)
    force = "--force" in argv
    argv = [a for a in argv if a != "--force"]
    if any(a == "--platform" or a.startswith("--platform=") for a in argv):
        return fail(f"k3-serve-{vendor} always serves on the {vendor} platform; use `k3 serve --platform NAME` "
                    "for another")
    if not any(a in ("-h", "--help") for a in argv):
        try:
            platform = select_platform(vendor)
        except PlatformError as e:
            return fail(str(e))
        if platform.info.forced and not force:     # forceable (the PPU's torch-native path), not detected
            reason = next((r.detection.reason for r in platform.records.values()
                           if r.detection is not None and r.detection.name == vendor), "it was not detected")
            return fail(f"platform {vendor!r} is unavailable: {reason}. k3-serve-{vendor} serves only where "
                        f"the platform is detected; `k3-serve-{vendor} --force` or `k3 serve --platform {vendor}` "
                        "runs the forced path")
    from .main import main

    return main(["serve", "--platform", vendor, *argv])
