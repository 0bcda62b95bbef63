"""Helpers shared by subcommands: model selection (a checkpoint directory or a hub repo id) and
error reporting."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3.config import ConfigError, K3Config
from k3.presets import PRESETS


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--preset NAME | --model DIR (exactly one), and the hub options of --model."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--preset", choices=list(PRESETS), help="a built-in model preset")
    group.add_argument("--model", metavar="DIR", help="a checkpoint directory (reads DIR/config.json) or a Hugging "
                                                      "Face repo id (org/name, from the hub cache)")
    add_hub_arguments(parser)


def add_hub_arguments(parser: argparse.ArgumentParser) -> None:
    """--revision and --download-dir (vLLM's): where a hub repo id given as the model comes from."""
    parser.add_argument("--revision", default=None, metavar="REV",
                        help="with a hub repo id as the model: the branch, tag or commit (default main)")
    parser.add_argument("--download-dir", default=None, metavar="DIR",
                        help="with a hub repo id as the model: the hub cache to read and download into (default "
                             "$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)")


def resolve_model_dir(args: argparse.Namespace) -> None:
    """Make args.model a checkpoint directory (in place): a hub repo id is resolved through the
    hub cache (k3.checkpoint.hub), the name as given kept in args.model_id (the default served
    model name); CliError (one line) when it is neither a checkpoint directory nor fetchable."""
    from k3.checkpoint.hub import HubError, resolve_model

    given = str(args.model)
    if getattr(args, "model_id", None) is None:
        args.model_id = given
    try:
        args.model = str(resolve_model(given, revision=getattr(args, "revision", None),
                                       download_dir=getattr(args, "download_dir", None)))
    except HubError as e:
        raise CliError(str(e)) from None
    check_model_dir(args.model)


def load_config(args: argparse.Namespace) -> K3Config:
    """The config named by --preset or --model; raises CliError with one clear sentence."""
    try:
        if args.preset:
            return K3Config.preset(args.preset)
        resolve_model_dir(args)
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
