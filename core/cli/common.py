"""Helpers shared by subcommands: model selection and error reporting."""

from __future__ import annotations

import argparse
import sys

from k3.config import ConfigError, K3Config
from k3.presets import PRESETS


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--preset NAME | --model DIR (exactly one)."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--preset", choices=list(PRESETS), help="a built-in model preset")
    group.add_argument("--model", metavar="DIR", help="a checkpoint directory (reads DIR/config.json)")


def load_config(args: argparse.Namespace) -> K3Config:
    """The config named by --preset or --model; raises CliError with one clear sentence."""
    try:
        if args.preset:
            return K3Config.preset(args.preset)
        return K3Config.from_pretrained(args.model)
    except (ConfigError, FileNotFoundError) as e:
        raise CliError(str(e)) from None


class CliError(Exception):
    """An error the CLI reports as one line on stderr (exit code 2), not a traceback."""


def fail(message: str, code: int = 2) -> int:
    print(f"k3: error: {message}", file=sys.stderr)
    return code
