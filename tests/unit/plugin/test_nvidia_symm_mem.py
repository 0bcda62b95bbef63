"""The NVIDIA plugin's symmetric-memory all-reduce is offered only where it can run: opted in
(K3_NVIDIA_SYMM_MEM=1), the platform reporting symmetric memory, an initialised NCCL group of
several ranks. Everywhere else the hook returns no backend and NCCL / gloo serve the op. (The
op itself needs GPUs: bench/symm_mem_allreduce.py checks it against NCCL.)"""

import dataclasses
import os
import socket

import pytest
import torch
import torch.distributed as dist

from k3.platforms.nvidia.symm_mem import ENV, SymmetricMemoryAllReduce, backends_for, enabled_by_env
from k3.plugin.types import Capabilities

WITH_SYMM = dataclasses.replace(Capabilities(), symmetric_memory=True)


@pytest.fixture
def gloo_world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_opt_in_only(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert not enabled_by_env()
    monkeypatch.setenv(ENV, "0")
    assert not enabled_by_env()
    monkeypatch.setenv(ENV, "1")
    assert enabled_by_env()


def test_no_backend_without_an_initialised_group(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    assert not dist.is_initialized()
    assert backends_for(None, WITH_SYMM) == []


def test_no_backend_on_gloo_or_one_rank_or_without_the_capability(monkeypatch, gloo_world_of_one):
    monkeypatch.setenv(ENV, "1")
    assert backends_for(None, WITH_SYMM) == []                # one rank, gloo
    assert backends_for(None, Capabilities()) == []           # no symmetric memory reported
    monkeypatch.setenv(ENV, "0")
    assert backends_for(None, WITH_SYMM) == []


def test_declines_what_it_cannot_hold():
    """accepts: all-reduce only, CUDA tensors of its dtypes within its buffer, and only when set up."""
    backend = SymmetricMemoryAllReduce.__new__(SymmetricMemoryAllReduce)
    backend.buffer, backend.max_bytes = None, 1 << 20
    x = torch.randn(4, 8)
    assert not backend.accepts("all_reduce", x)               # not set up
    backend.buffer = torch.empty(0)                           # stands in for a set-up buffer
    assert not backend.accepts("all_reduce", x)               # a CPU tensor
    assert not backend.accepts("all_gather", x)
    assert not hasattr(backend, "all_gather")                 # the dispatcher passes over it for all_gather
