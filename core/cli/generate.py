"""`k3 generate`: one prompt or chat turn on the CPU reference path, streamed to stdout.

stdout holds the generated text only (with --chat: reasoning, content and tool calls, each
under its own label); the loading progress, statistics and notices go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from k3.engine.single import SamplingOptions, SingleSequenceGenerator
from k3.engine.stop import StopStringMatcher

from .common import CliError

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
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


def _check(args: argparse.Namespace) -> None:
    if args.max_tokens < 1:
        raise CliError("--max-tokens must be at least 1")
    if args.temperature < 0:
        raise CliError("--temperature must be >= 0")
    if not 0 < args.top_p <= 1:
        raise CliError("--top-p must be in (0, 1]")
    if args.top_k < 0 or not 0 <= args.min_p <= 1:
        raise CliError("--top-k must be >= 0 and --min-p in [0, 1]")


def _load(args: argparse.Namespace):
    from k3.checkpoint.loader import CheckpointError, load_model
    from k3.config import ConfigError
    from k3.tokenizer import load_tokenizer

    try:
        dtype = None if args.dtype == "auto" else DTYPES[args.dtype]
        model = load_model(args.model, dtype=dtype)
        tokenizer = load_tokenizer(args.model)
    except (CheckpointError, ConfigError, FileNotFoundError, ValueError) as e:
        raise CliError(str(e)) from None
    return model, tokenizer


def _chat_prompt_ids(args, tokenizer) -> list[int]:
    """The chat turn in the model's format (marker text inside the message stays text)."""
    from k3.chat.template import chat_prompt_ids

    kwargs = {"thinking": not args.no_thinking}
    if args.thinking_effort:
        kwargs["thinking_effort"] = args.thinking_effort
    return chat_prompt_ids(tokenizer, [{"role": "user", "content": args.chat}], **kwargs)


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
    from k3.tokenizer import IncrementalDetokenizer

    _check(args)
    model, tokenizer = _load(args)
    if args.chat is not None:
        prompt_ids = _chat_prompt_ids(args, tokenizer)
        printer = (_ChatPrinter(sys.stdout, thinking=not args.no_thinking) if tokenizer.flavor == "k3"
                   else _RawPrinter(sys.stdout))
    else:
        prompt_ids, printer = tokenizer.encode(args.prompt, allow_special=True), _RawPrinter(sys.stdout)
    options = SamplingOptions(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                              stop_token_ids=tuple(model.cfg.eos_token_ids))
    detok = IncrementalDetokenizer(tokenizer)
    stops = StopStringMatcher(args.stop)
    start = time.perf_counter()
    first = None
    count, finish = 0, "length"
    try:
        for step in SingleSequenceGenerator(model).generate(prompt_ids, options):
            first = first or time.perf_counter()
            count += 1
            if step.finished == "stop":
                finish = "stop"
                break
            printer.write(stops.push(detok.step([step.token])))
            if stops.stopped is not None:
                finish = "stop"
                break
    except ValueError as e:
        raise CliError(str(e)) from None
    if stops.stopped is None:
        printer.write(stops.push(detok.finish()) + stops.flush())
    printer.close()
    end = time.perf_counter()
    decode = (count - 1) / (end - first) if first and count > 1 and end > first else 0.0
    print(f"k3: {len(prompt_ids)} prompt tokens, {count} generated, time to first token "
          f"{(first or end) - start:.3f} s, decode {decode:.1f} tokens/s, finish: {finish}", file=sys.stderr)
    return 0
