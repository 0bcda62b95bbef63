"""`k3 generate`: one prompt or chat turn, streamed to stdout, on the platform `k3 serve` would
pick (--platform, else $K3_PLATFORM, else detection), so that one request decodes as fast per
token as one request on the server (the server's larger tokens/s under load is batching: its
time per output token at one request is what this reports).

stdout holds the generated text only (with --chat: reasoning, content and tool calls, each
under its own label); the loading progress, statistics and notices go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

from k3.dtype_names import DTYPE_NAMES as DTYPES

from .common import CliError, add_hub_arguments, resolve_model_dir

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="checkpoint directory or Hugging Face repo id (org/name, from the hub cache)")
    add_hub_arguments(parser)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", metavar="TEXT", help="raw prompt text (special-token strings allowed)")
    what.add_argument("--chat", metavar="TEXT", help="one user message, rendered with the model's chat format")
    parser.add_argument("--max-tokens", type=int, default=128, metavar="N")
    parser.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 = greedy (default 1.0)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off")
    parser.add_argument("--min-p", type=float, default=0.0, metavar="P")
    parser.add_argument("--seed", type=int, default=None, metavar="S")
    parser.add_argument("--stop", action="append", default=[], metavar="S",
                        help="stop string (repeatable); may span tokens")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="activation dtype (auto: the checkpoint's)")
    parser.add_argument("--no-thinking", action="store_true", help="--chat: instruct mode (no reasoning)")
    parser.add_argument("--thinking-effort", choices=["low", "medium", "high", "max"], default=None,
                        help="--chat: K3 thinking effort")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, vLLM\'s shape, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    parser.add_argument("--kv-cache-memory", type=float, default=0.25, metavar="GIB",
                        help="cache memory on the CPU (default 0.25)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                        help="accelerators: the fraction of device memory for weights, workspace and cache "
                             "(default 0.9, as k3 serve)")
    parser.add_argument("--platform", default=None, metavar="NAME",
                        help="platform to run on (default: $K3_PLATFORM, else detection, as k3 serve)")


def _check(args: argparse.Namespace) -> None:
    if args.max_tokens < 1:
        raise CliError("--max-tokens must be at least 1")
    if args.temperature < 0:
        raise CliError("--temperature must be >= 0")
    if not 0 < args.top_p <= 1:
        raise CliError("--top-p must be in (0, 1]")
    if args.top_k < 0 or not 0 <= args.min_p <= 1:
        raise CliError("--top-k must be >= 0 and --min-p in [0, 1]")


def _engine(args: argparse.Namespace):
    """One-request engine on --platform, else $K3_PLATFORM, else the detected platform (as
    `k3 serve`; it used to force the CPU reference ops, which on an accelerator host decoded
    several times slower than the server on the same model)."""
    from k3.checkpoint.loader import CheckpointError
    from k3.config import ConfigError
    from k3.engine.engine import EngineConfig, LLMEngine
    from k3.platform import PlatformError

    try:
        return LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=1, platform=args.platform,
                                      kv_cache_memory_gib=args.kv_cache_memory,
                                      gpu_memory_utilization=args.gpu_memory_utilization,
                                      speculative_config=args.speculative_config))
    except (CheckpointError, ConfigError, FileNotFoundError, PlatformError, ValueError) as e:
        raise CliError(str(e)) from None


def _chat_prompt_ids(args, tokenizer) -> list[int]:
    """The chat turn in the model's format (marker text inside the message stays text); a
    CliError naming the absent markers when the tokenizer has no chat format."""
    from k3.chat import ChatFormatUnavailable
    from k3.chat.template import chat_prompt_ids

    kwargs = {"thinking": not args.no_thinking}
    if args.thinking_effort:
        kwargs["thinking_effort"] = args.thinking_effort
    try:
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": args.chat}], **kwargs)
    except ChatFormatUnavailable as e:
        raise CliError(f"--chat: {e}; use --prompt for this model") from None


class _ChatPrinter:
    """Prints parsed K3 output under [reasoning] / [content] / [tool call] labels."""

    def __init__(self, out, thinking: bool):
        from k3.chat import K3OutputParser

        self.out, self.section = out, None
        self.parser = K3OutputParser(thinking=thinking)

    def _print(self, events) -> None:
        from k3.chat import ContentDelta, ReasoningDelta

        for ev in events:
            if isinstance(ev, (ReasoningDelta, ContentDelta)):
                label = "reasoning" if isinstance(ev, ReasoningDelta) else "content"
                if self.section != label:
                    self.out.write(("\n" if self.section else "") + f"[{label}]\n")
                    self.section = label
                self.out.write(ev.text)
            else:
                self.out.write(("\n" if self.section else "") + f"[tool call] {ev.name} {ev.arguments}\n")
                self.section = "tool call"
        self.out.flush()

    def write(self, text: str) -> None:
        self._print(self.parser.feed(text))

    def close(self) -> None:
        self._print(self.parser.finish())
        self.out.write("\n")


class _RawPrinter:
    def __init__(self, out):
        self.out = out

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def close(self) -> None:
        self.out.write("\n")


def run(args: argparse.Namespace) -> int:
    from k3.engine.params import SamplingParams

    _check(args)
    resolve_model_dir(args)
    engine = _engine(args)
    tokenizer = engine.tokenizer
    if args.chat is not None:
        prompt_ids = _chat_prompt_ids(args, tokenizer)
        printer = (_ChatPrinter(sys.stdout, thinking=not args.no_thinking) if tokenizer.flavor == "k3"
                   else _RawPrinter(sys.stdout))
    else:
        prompt_ids, printer = tokenizer.encode(args.prompt, allow_special=True), _RawPrinter(sys.stdout)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                            skip_special_tokens=False)
    start = time.perf_counter()
    try:
        engine.add_request("generate", prompt_ids, params)
    except ValueError as e:
        raise CliError(str(e)) from None
    first = last = None
    shown = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            completion = out.outputs[0]
            if completion.token_ids and first is None:
                first = time.perf_counter()
            printer.write(completion.text[len(shown):])
            shown = completion.text
            last = out
    printer.close()
    end = time.perf_counter()
    completion = last.outputs[0]
    count = len(completion.token_ids)
    decode = (count - 1) / (end - first) if first and count > 1 and end > first else 0.0
    spec = engine.spec_stats()
    extra = f", mean acceptance length {spec['spec_mean_acceptance_length']:.2f}" if spec else ""
    tpot = f" (time per output token {1000 / decode:.1f} ms)" if decode else ""
    print(f"k3: {len(prompt_ids)} prompt tokens, {count} generated, time to first token "
          f"{(first or end) - start:.3f} s, decode {decode:.1f} tokens/s{tpot}{extra} on {engine.platform.name}, "
          f"finish: {completion.finish_reason}", file=sys.stderr)
    return 0
