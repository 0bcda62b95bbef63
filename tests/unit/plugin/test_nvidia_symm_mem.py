"""The NVIDIA plugin's symmetric-memory all-reduce and all-gather are offered only where they
can run: opted in (K3_NVIDIA_SYMM_MEM=1), the platform reporting symmetric memory, an
initialised NCCL group of several ranks, and each set up on every rank (one rank's failure
turns it off on all: two gloo processes). Everywhere else the hook returns no backend and NCCL /
gloo serve the op; each backend declines what it cannot hold. The all-gather's reading of the
peers' buffers runs here on a stand-in handle; the ops themselves need GPUs
(bench/symm_mem_allreduce.py checks them against NCCL, conformance's collectives cases on 2+)."""

import dataclasses
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from k3.platforms.nvidia.symm_mem import (ENV, GATHER_DTYPES, SymmetricMemoryAllGather, SymmetricMemoryAllReduce,
                                          backends_for, enabled_by_env)
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


class _DeviceTensor:
    """What `accepts` reads of a CUDA tensor (this machine has none)."""

    def __init__(self, numel: int, dtype: torch.dtype):
        self.is_cuda, self.dtype, self._numel = True, dtype, numel

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()


def test_all_gather_accepts_only_what_its_buffer_holds():
    backend = SymmetricMemoryAllGather.__new__(SymmetricMemoryAllGather)
    backend.buffer, backend.max_bytes = None, 1 << 10
    assert not backend.accepts("all_gather", _DeviceTensor(8, torch.bfloat16))     # not set up
    backend.buffer = torch.empty(0)
    assert backend.accepts("all_gather", _DeviceTensor(512, torch.bfloat16))       # 1 KiB: fits
    assert backend.accepts("all_gather", _DeviceTensor(256, torch.int32))          # DCP top-k words
    assert not backend.accepts("all_gather", _DeviceTensor(513, torch.bfloat16))   # past the buffer
    assert not backend.accepts("all_gather", _DeviceTensor(8, torch.float64))
    assert not backend.accepts("all_reduce", _DeviceTensor(8, torch.bfloat16))
    assert not backend.accepts("all_gather", torch.randn(4, 8))                     # a CPU tensor
    assert not hasattr(backend, "all_reduce")
    assert torch.int32 in GATHER_DTYPES and torch.float64 not in GATHER_DTYPES


class _Handle:
    """torch's symmetric-memory handle for one rank of a simulated group: get_buffer views of
    every rank's buffer, barriers counted."""

    def __init__(self, buffers):
        self.buffers, self.barriers = buffers, 0

    def barrier(self, channel=0):
        self.barriers += 1

    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        return self.buffers[rank].view(dtype)[storage_offset: storage_offset + sizes[0]].view(sizes)


@pytest.mark.parametrize("shape,dim", [((3, 5), 0), ((3, 5), -1), ((2, 3, 4), 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32])
def test_all_gather_reads_every_rank_in_order(shape, dim, dtype):
    world = 3
    g = torch.Generator().manual_seed(len(shape) + dim)
    inputs = [torch.randn(shape, generator=g).mul(100).to(dtype) for _ in range(world)]
    buffers = [torch.full((1024,), 0xFF, dtype=torch.uint8) for _ in range(world)]
    for r in (1, 2):                                       # the peers have staged their inputs
        buffers[r].view(dtype)[: inputs[r].numel()].copy_(inputs[r].reshape(-1))
    backend = SymmetricMemoryAllGather.__new__(SymmetricMemoryAllGather)
    backend.buffer, backend.max_bytes, backend.world_size = buffers[0], 1024, world
    backend.handle = _Handle(buffers)
    x = inputs[0].transpose(0, -1).contiguous().transpose(0, -1)     # a non-contiguous input
    out = backend.all_gather(x, dim)
    assert torch.equal(out, torch.cat(inputs, dim)) and out.dtype == dtype
    assert backend.handle.barriers == 2                    # inputs staged before reading, read before reuse


SCENARIOS = {"": True, "1": False, "0,1": False}       # ranks whose set-up fails -> active on every rank
_AGREEMENT = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from k3.platforms.nvidia import symm_mem

    rank, init = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    for fail in sys.argv[3:]:
        def setup(self, fail=fail):     # stands in for symm_mem.empty + rendezvous
            if str(rank) in fail.split(","):
                raise RuntimeError(f"rank {rank} has no peer access")
            return torch.empty(self.max_bytes, dtype=torch.uint8), object()

        symm_mem._SymmetricBuffer._setup = setup
        for cls in (symm_mem.SymmetricMemoryAllReduce, symm_mem.SymmetricMemoryAllGather):
            print(repr(fail), cls.op, cls(dist.group.WORLD, device="cpu", max_bytes=1024).active, flush=True)
            print(f"done {fail!r} {cls.op}", file=sys.stderr, flush=True)
    dist.barrier()
    os._exit(0)     # gloo's teardown at exit can abort ("terminate called without an active exception")
""")


def test_set_up_is_every_rank_or_none(tmp_path):
    """Both ranks set up, one fails, both fail: each backend is active on every rank or none,
    and a rank whose set-up failed says why."""
    script = tmp_path / "agree.py"
    script.write_text(_AGREEMENT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "rendezvous"), *SCENARIOS],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-1500:] for o in outs]
    for rank, (out, err) in enumerate(outs):
        want = [f"{fail!r} {op} {active}" for fail, active in SCENARIOS.items() for op in ("all_reduce", "all_gather")]
        assert out.splitlines() == want, (rank, out)
        blocks = err.split("done ")
        for i, (fail, _) in enumerate((f, op) for f in SCENARIOS for op in ("all_reduce", "all_gather")):
            said = "symmetric-memory all_" in blocks[i] and "off: RuntimeError: rank" in blocks[i]
            assert said == (str(rank) in fail.split(",")), (rank, fail, blocks[i][-300:])
