"""`k3 checkpoint init`: write a deterministic random-weight checkpoint of a preset."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

from k3.config import K3Config
from k3.presets import DRAFT_PRESETS, PRESETS

from .common import CliError

LARGE_CHECKPOINT_BYTES = 64 * 1024 ** 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    init = sub.add_parser("init", help="write a random-weight checkpoint of a preset",
                          description="Write a deterministic random-weight checkpoint (HF layout: config.json, "
                                      "sharded safetensors with an index, generation_config.json, tokenizer).")
    init.add_argument("--preset", required=True, choices=[*PRESETS, *DRAFT_PRESETS],
                      help="a model preset, or a draft preset (k3-tiny-dspark: a DSpark draft for k3-tiny)")
    init.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")
    init.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    init.add_argument("--max-shard-size", type=float, default=2.0, metavar="GIB",
                      help="largest safetensors shard in GiB (default 2)")
    init.add_argument("--config-only", action="store_true",
                      help="write config.json, generation_config.json and the tokenizer (tiny presets) but no "
                           "weights: for `--load-format dummy`, which draws random weights on the device")
    init.add_argument("--force", action="store_true",
                      help=f"write even when the checkpoint exceeds {LARGE_CHECKPOINT_BYTES // 1024 ** 3} GiB "
                           "or the directory already holds one")


def init_checkpoint(preset: str, out: Path, *, seed: int = 0, max_shard_bytes: int = 2 * 1024 ** 3,
                    progress: bool = True) -> Path:
    """Write the random checkpoint of `preset` into `out` (see `k3 checkpoint init`)."""
    from k3.checkpoint.random_init import checkpoint_tensor_specs, random_checkpoint
    from k3.checkpoint.writer import write_checkpoint

    cfg = K3Config.preset(preset)
    total = sum(_numel(shape) * dtype.itemsize for _, shape, dtype, _ in checkpoint_tensor_specs(cfg))
    with tqdm(total=total, desc=f"writing {preset}", unit="B", unit_scale=True, disable=not progress,
              file=sys.stderr) as bar:
        write_checkpoint(out, cfg, random_checkpoint(cfg, seed=seed), max_shard_bytes=max_shard_bytes,
                         progress=bar.update)
    _write_tokenizer(out, cfg)
    return out


def _write_tokenizer(out: Path, cfg: K3Config) -> None:
    """Tiny checkpoints ship the compact vocabulary; real presets' vocabularies are not public here."""
    if cfg.vocab_size > 1024:
        print(f"k3: {out} has no tokenizer files (the {cfg.vocab_size}-token vocabulary is not bundled); "
              "copy tiktoken.model and tokenizer_config.json from the published checkpoint", file=sys.stderr)
        return
    from k3.tokenizer import write_compact_tokenizer

    write_compact_tokenizer(out, flavor="k3" if cfg.model_type == "kimi_k3" else "k2")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def init_draft_checkpoint(preset: str, out: Path, *, seed: int = 0) -> Path:
    """Write a random draft checkpoint (config.json + safetensors) of a draft preset."""
    import json

    from k3.checkpoint.random_init import random_draft_checkpoint
    from k3.checkpoint.writer import INDEX_FILE
    from safetensors.torch import save_file

    raw = DRAFT_PRESETS[preset]()
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(random_draft_checkpoint(raw, seed=seed))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / INDEX_FILE).unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.preset in DRAFT_PRESETS:
        if (out / "config.json").exists() and not args.force:
            raise CliError(f"{out} already holds a checkpoint; pass --force to overwrite it")
        init_draft_checkpoint(args.preset, out, seed=args.seed)
        print(f"k3: wrote the {args.preset} draft (seed {args.seed}) to {out}", file=sys.stderr)
        return 0
    from k3.checkpoint.random_init import checkpoint_tensor_specs
    from k3.checkpoint.writer import write_config

    cfg = K3Config.preset(args.preset)
    if args.config_only:
        if (out / "config.json").exists() and not args.force:
            raise CliError(f"{out} already holds a checkpoint; pass --force to overwrite it")
        out.mkdir(parents=True, exist_ok=True)
        write_config(out, cfg)
        _write_tokenizer(out, cfg)
        print(f"k3: wrote the {args.preset} config (no weights: serve it with --load-format dummy) to {out}",
              file=sys.stderr)
        return 0
    total = sum(_numel(shape) * dtype.itemsize for _, shape, dtype, _ in checkpoint_tensor_specs(cfg))
    if total > LARGE_CHECKPOINT_BYTES and not args.force:
        raise CliError(f"the {args.preset} checkpoint takes {total / 1024 ** 3:,.0f} GiB; pass --force to write it")
    if (out / "config.json").exists() and not args.force:
        raise CliError(f"{out} already holds a checkpoint; pass --force to overwrite it")
    init_checkpoint(args.preset, out, seed=args.seed, max_shard_bytes=int(args.max_shard_size * 1024 ** 3))
    print(f"k3: wrote {args.preset} (seed {args.seed}, {total / 1024 ** 2:,.1f} MiB) to {out}", file=sys.stderr)
    return 0
