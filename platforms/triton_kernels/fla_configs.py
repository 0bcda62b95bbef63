"""Tuned launch configurations for fla-core's kernels, shipped with k3 per GPU model, so a
server's first prefill compiles one configuration per kernel instead of autotuning every
configuration of every kernel (minutes on an H200 for each new head/dim shape).

fla-core reads configurations from `$FLA_CONFIG_DIR/<kernel name>.json` when FLA_CACHE_MODE
allows it. `pin()` points it at `fla_configs/<GPU name>/` beside this file, in "full" mode: the
entry tuned for the same autotune key, else one of the same structure and dtypes (a head count
or dimension of another size), else the file's default (the K3-dims bf16 choice). GPUs without a
folder, and users who set FLA_CONFIG_DIR or FLA_CACHE_MODE themselves, keep fla-core's own
behaviour.

The folders are made on the GPU itself by autotuning at K3's dimensions and writing what the
autotuner chose:

    python3 -m k3.platforms.triton_kernels.fla_configs --out fla_configs.json     # on the GPU
    python3 -m k3.platforms.triton_kernels.fla_configs --unpack fla_configs.json  # in a checkout
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).parent / "fla_configs"
log = logging.getLogger(__name__)
_pinned: list[Path | None] = []                 # the decision, made once per process


def gpu_folder_name(device_name: str) -> str:
    """fla-core's spelling of a GPU model as a folder name ("NVIDIA H200" -> "NVIDIA_H200")."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") or "unknown_gpu"


def pin(device_name: str | None = None) -> Path | None:
    """Point fla-core at k3's configurations for this GPU; the folder used, or None (no folder for
    this GPU, or the user chose fla-core's settings). Call before fla-core's kernels first run."""
    if _pinned:
        return _pinned[0]
    if device_name is None:
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    folder = ROOT / gpu_folder_name(device_name)
    chosen = None
    user_set = "FLA_CONFIG_DIR" in os.environ or "FLA_CACHE_MODE" in os.environ
    if not folder.is_dir() and not user_set:
        log.warning("k3 ships no fla-core launch configurations for %s: fla-core's chunked KDA kernels autotune "
                    "on first use (minutes for each new head count or dimension). To make them on this GPU: "
                    "python3 -m k3.platforms.triton_kernels.fla_configs --out fla_configs.json, then --unpack it "
                    "in a k3 checkout (or point FLA_CONFIG_DIR at a folder of them).", device_name)
    if folder.is_dir() and not user_set:
        os.environ["FLA_CONFIG_DIR"] = str(folder)
        os.environ["FLA_CACHE_MODE"] = "full"
        cache = sys.modules.get("fla.ops.utils.cache")
        if cache is not None:                     # fla-core read FLA_CACHE_MODE when it was imported
            cache.FLA_CACHE_MODE = cache.FlaCacheMode.FULL
        chosen = folder
    _pinned.append(chosen)
    return chosen


def _config_json(config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None),
            "ir_override": getattr(config, "ir_override", None)}


def _autotuner(obj):
    """The Autotuner under a module attribute: fla-core stacks @triton.heuristics over its
    autotuners, so the attribute is often the Heuristics object whose `.fn` is the tuner."""
    from triton.runtime.autotuner import Autotuner

    for _ in range(4):
        if isinstance(obj, Autotuner):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def tuned_configs(prefer_dtype: str = "torch.bfloat16") -> dict[str, dict]:
    """Every fla-core autotuner that has chosen a configuration in this process, as fla-core's
    config files ({kernel name: file content}); the default is the first choice made for
    `prefer_dtype` inputs (the first tuned, so tune K3's shape first)."""
    import triton
    from fla.ops.utils.cache import AutotuneKey

    files = {}
    for name, module in sorted(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for tuner in map(_autotuner, vars(module).values()):
            if tuner is None or not tuner.cache:
                continue
            kernel = getattr(tuner, "kernel_name", None) or tuner.fn.__name__
            entries = {AutotuneKey.key_hash(list(key)): {"autotune_key": list(key), "config": _config_json(config)}
                       for key, config in tuner.cache.items()}
            preferred = [e for e in entries.values() if prefer_dtype in e["autotune_key"]]
            default = (preferred or list(entries.values()))[0]["config"]
            files[kernel] = {"kernel_name": kernel, "triton_version": triton.__version__,
                             "gpu": torch.cuda.get_device_name(), "autotune_entries": entries,
                             "default_config": default}
    return files


def tune(shapes: list[tuple[str, int, int, int, bool]], out: Path) -> None:
    """Run fla-core's chunk_kda once per (dtype, tokens, heads, head dim, varlen) so its autotuners
    choose, rewriting the bundle `out` after each (autotuning takes minutes: a run cut short keeps
    what it finished); the inputs are K3's (log-decay gates, beta after sigmoid, fp32 initial state)."""
    from fla.ops.kda import chunk_kda

    for dtype_name, tokens, heads, dim, varlen in shapes:
        dtype = getattr(torch, dtype_name)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k = (torch.nn.functional.normalize(torch.randn(1, tokens, heads, dim, device="cuda", generator=g), dim=-1)
                .to(dtype) for _ in range(2))
        v = torch.randn(1, tokens, heads, dim, device="cuda", generator=g).to(dtype)
        gate = -torch.rand(1, tokens, heads, dim, device="cuda", generator=g).to(dtype)
        beta = torch.rand(1, tokens, heads, device="cuda", generator=g).to(dtype)
        sequences = 2 if varlen else 1
        state = torch.randn(sequences, heads, dim, dim, device="cuda", generator=g)
        cu = torch.tensor([0, tokens // 2, tokens] if varlen else [0, tokens], dtype=torch.int64, device="cuda")
        chunk_kda(q, k, v, gate, beta, scale=dim ** -0.5, initial_state=state, output_final_state=True,
                  cu_seqlens=cu)
        torch.cuda.synchronize()
        files = tuned_configs()
        out.write_text(json.dumps(files, indent=1, sort_keys=True) + "\n")
        print(f"tuned {dtype_name} T={tokens} H={heads} D={dim} varlen={varlen}: {len(files)} kernels "
              f"({', '.join(sorted(files))}) -> {out}", flush=True)


def unpack(bundle: Path) -> Path:
    files = json.loads(bundle.read_text())
    gpus = {content["gpu"] for content in files.values()}
    if len(gpus) != 1:
        raise SystemExit(f"{bundle}: expected configurations of one GPU, found {sorted(gpus)}")
    folder = ROOT / gpu_folder_name(gpus.pop())
    folder.mkdir(parents=True, exist_ok=True)
    for kernel, content in files.items():
        (folder / f"{kernel}.json").write_text(json.dumps(content, indent=1, sort_keys=True) + "\n")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="autotune on this GPU and write the bundle here")
    parser.add_argument("--unpack", type=Path, help="write a bundle's files into fla_configs/<GPU>/")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32", "float16"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=96, help="KDA heads (K3: 96)")
    parser.add_argument("--dim", type=int, default=128, help="KDA head dim (K3: 128)")
    args = parser.parse_args()
    if args.unpack:
        print(f"wrote {unpack(args.unpack)}")
        return
    if not args.out:
        parser.error("give --out (tune on the GPU) or --unpack")
    os.environ["FLA_CACHE_MODE"] = "disabled"   # tune from scratch, whatever the folder holds
    shapes = [(d, args.tokens, args.heads, args.dim, varlen) for d in args.dtypes for varlen in (False, True)]
    tune(shapes, args.out)


if __name__ == "__main__":
    main()
