"""Shared fixtures: tiny random checkpoints written once per session.

Under pytest-xdist (the README's `-n auto`, one worker per core) each worker and the processes it
starts use one torch thread: N workers with N threads each would oversubscribe the cores, and the
tiny shapes here gain nothing from intra-op threads."""

import os
from pathlib import Path

import torch

import pytest

from k3.checkpoint.random_init import random_checkpoint
from k3.checkpoint.writer import write_checkpoint
from k3.config import K3Config

# the tpu tier runs in its own torch 2.9 + torch-xla venv (.ci/tpu.sh, with --confcutdir=tests/tpu,
# so this file is not read there); the main suite never collects it
collect_ignore = ["tpu"]

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"      # inherited by the ranks multi-process tests spawn
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(preset, seed=0) -> directory of a random checkpoint (cached per session)."""
    made: dict[tuple[str, int], Path] = {}

    def make(preset: str, seed: int = 0) -> Path:
        if (preset, seed) not in made:
            cfg = K3Config.preset(preset)
            out = tmp_path_factory.mktemp(f"{preset}-{seed}")
            write_checkpoint(out, cfg, random_checkpoint(cfg, seed=seed), max_shard_bytes=256 * 1024)
            made[preset, seed] = out
        return made[preset, seed]

    return make


@pytest.fixture(scope="session")
def tokenized_checkpoint(tmp_path_factory):
    """tokenized_checkpoint(preset) -> a random checkpoint with its compact tokenizer, as
    `k3 checkpoint init` writes it (the engine's text paths need the tokenizer); once per session."""
    from k3.cli.checkpoint import init_checkpoint

    made: dict[str, Path] = {}

    def make(preset: str) -> Path:
        if preset not in made:
            made[preset] = init_checkpoint(preset, tmp_path_factory.mktemp(f"{preset}-tokenized"), progress=False)
        return made[preset]

    return make
