"""`k3`: the command-line entry point. Each subcommand lives in its own module.

`k3 --help`, `k3 COMMAND --help` and argument errors answer without importing torch: the
subcommand modules are imported only when their command is on the command line, and they
import torch (the engine, the model, the cache) inside `run`, not at module level.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .common import CliError, fail
from .parser import K3ArgumentParser

# (module, help) per subcommand; a module provides add_arguments(parser) and run(args) -> int,
# and may provide resolve_arguments(args, parser) (checks across flags, reported as usage errors).
SUBCOMMANDS = {
    "info": ("k3.cli.info", "architecture summary of a preset or a checkpoint"),
    "checkpoint": ("k3.cli.checkpoint", "make checkpoints (random weights for tests and benchmarks)"),
    "generate": ("k3.cli.generate",
                 "generate text for one prompt or chat turn (one request, on the platform k3 serve picks)"),
    "serve": ("k3.cli.serve", "the OpenAI-compatible server (vLLM-style flags)"),
    "plan": ("k3.cli.plan", "the packed cache plan and its capacity for a memory budget"),
    "plugins": ("k3.cli.plugins", "plugins, platforms, kernel providers"),
    "conformance": ("k3.cli.conformance", "check a platform against the reference"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `k3` parser. With argv, only the subcommand argv names gets its options (the others'
    modules are not imported); without, every subcommand does."""
    parser = K3ArgumentParser(prog="k3", description="Serve Kimi K3-architecture models.")
    parser.add_argument("--version", action="version", version=f"k3 {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = None if argv is None else _command_of(argv)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = parser.add_command(sub, name, help=help_text, description=help_text)
        if argv is None or name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_module=module)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand argv names (the first word that is not an option), else None."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in SUBCOMMANDS else None
    return None


def _version() -> str:
    from k3 import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    module = getattr(args, "_module", None)
    if module is None:
        parser.print_help(sys.stderr)
        return 2
    resolve = getattr(module, "resolve_arguments", None)
    if resolve is not None:
        resolve(args, parser._commands[("command", args.command)])
    try:
        return module.run(args)
    except CliError as e:
        return fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
