"""`k3`: the command-line entry point. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import sys

from . import checkpoint, conformance, generate, info, plan, plugins, serve
from .common import CliError, fail

# (module, help) per subcommand; a module provides add_arguments(parser) and run(args) -> int.
SUBCOMMANDS = {
    "info": (info, "architecture summary of a preset or a checkpoint"),
    "checkpoint": (checkpoint, "make checkpoints (random weights for tests and benchmarks)"),
    "generate": (generate, "generate text for one prompt or chat turn on the CPU reference path"),
    "serve": (serve, "the OpenAI-compatible server (vLLM-style flags)"),
    "plan": (plan, "the packed cache plan and its capacity for a memory budget"),
    "plugins": (plugins, "plugins, platforms, kernel providers"),
    "conformance": (conformance, "check a platform against the reference"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3", description="Serve Kimi K3-architecture models.")
    parser.add_argument("--version", action="version", version=f"k3 {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _version() -> str:
    from k3 import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return args._run(args)
    except CliError as e:
        return fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
