"""Helpers shared by subcommands: model selection and error reporting."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
        check_model_dir(args.model)
        return K3Config.from_pretrained(args.model)
    except (ConfigError, FileNotFoundError) as e:
        raise CliError(str(e)) from None


def check_model_dir(model: str | Path) -> None:
    """CliError, in the one wording every command uses, unless `model` is a checkpoint
    directory (holds config.json)."""
    if not (Path(model) / "config.json").is_file():
        raise CliError(missing_model_message(model))


def missing_model_message(model: str | Path) -> str:
    """The sentence for a model path that is not a checkpoint directory."""
    return f"{model} is not a checkpoint directory (no config.json there)"


class CliError(Exception):
    """An error the CLI reports as one line on stderr (exit code 2), not a traceback."""


def fail(message: str, code: int = 2) -> int:
    print(f"k3: error: {message}", file=sys.stderr)
    return code
