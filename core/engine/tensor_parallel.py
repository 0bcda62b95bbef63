"""Tensor parallelism: one process per rank. Rank 0 runs the engine (scheduler, sampling,
output) and broadcasts each step's ForwardMetadata; ranks 1..N-1 build the same engine
state (so their caches have the same rows and layout) and only run forwards.

Worker ranks are fresh interpreters (`python -m k3.engine.tensor_parallel`), not
multiprocessing children, so the caller's main module is never re-imported.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

from k3.platform import select_platform
from k3.model.metadata import CheckpointMetadata, ForwardMetadata

from .engine import EngineConfig, LLMEngine

_STEP, _STOP = 1, 0
_FIELDS = ("input_ids", "positions", "cu_seqlens", "context_lens", "slot_mapping", "state_indices", "logits_indices")
_HEADER = 9


def _send(meta: ForwardMetadata | None, device, row_copies=()) -> None:
    """Rank 0: the step's metadata and row copies to every other rank (None: stop)."""
    if meta is None:
        dist.broadcast(torch.zeros(_HEADER, dtype=torch.long, device=device), src=0)
        return
    n, pages = meta.block_table.shape
    c = 0 if meta.checkpoints is None else meta.checkpoints.positions.shape[1]
    header = torch.tensor([_STEP, meta.max_q_len, meta.num_tokens, n, pages, meta.logits_indices.shape[0], c,
                           len(row_copies), meta.num_decodes], device=device)
    dist.broadcast(header, src=0)
    parts = [getattr(meta, f).long().flatten() for f in _FIELDS] + [meta.block_table.long().flatten()]
    if c:
        parts += [meta.checkpoints.positions.flatten(), meta.checkpoints.state_indices.flatten()]
    parts.append(torch.tensor([x for pair in row_copies for x in pair], dtype=torch.long, device=device))
    dist.broadcast(torch.cat([p.to(device) for p in parts]), src=0)


def _receive(device) -> tuple[ForwardMetadata, list[tuple[int, int]]] | None:
    header = torch.empty(_HEADER, dtype=torch.long, device=device)
    dist.broadcast(header, src=0)
    cmd, max_q_len, t, n, pages, m, c, copies, num_decodes = header.tolist()
    if cmd == _STOP:
        return None
    sizes = [t, t, n + 1, n, t, n, m, n * pages, n * c, n * c, 2 * copies]
    payload = torch.empty(sum(sizes), dtype=torch.long, device=device)
    dist.broadcast(payload, src=0)
    parts = payload.split(sizes)
    fields = dict(zip(_FIELDS, parts[:7]))
    fields["cu_seqlens"] = fields["cu_seqlens"].int()
    meta = ForwardMetadata(block_table=parts[7].view(n, pages).int(), max_q_len=max_q_len, num_decodes=num_decodes,
                           **fields)
    if c:
        meta.checkpoints = CheckpointMetadata(parts[8].view(n, c), parts[9].view(n, c))
    pairs = parts[10].tolist()
    return meta, list(zip(pairs[0::2], pairs[1::2]))


def _init(rank: int, world: int, init_file: str, config: EngineConfig, platform, **engine_options) -> LLMEngine:
    dist.init_process_group(platform.capabilities.dist_backend, init_method=f"file://{init_file}",
                            rank=rank, world_size=world)
    engine = LLMEngine(config, platform=platform, parallel=platform.parallel_context(), **engine_options)
    rows = torch.tensor([engine.pool.num_rows], device=engine.device)
    dist.all_reduce(rows, op=dist.ReduceOp.MIN)
    if rows.item() != engine.pool.num_rows:
        raise RuntimeError(f"tensor-parallel ranks sized their caches differently ({rows.item()} vs "
                           f"{engine.pool.num_rows} rows): give every rank the same memory")
    return engine


def _worker(rank: int, world: int, init_file: str, config: EngineConfig) -> None:
    # Ctrl-C reaches the whole process group: rank 0 stops the workers through the broadcast.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine = _init(rank, world, init_file, config, select_platform(config.platform))
    while (step := _receive(engine.device)) is not None:
        engine.runner.forward(*step)
    dist.destroy_process_group()


def start_tensor_parallel(config: EngineConfig) -> LLMEngine:
    """Start ranks 1..N-1, join as rank 0 and return rank 0's engine (shut down at exit)."""
    world = config.tensor_parallel_size
    rendezvous = tempfile.mkdtemp(prefix="k3-tp-")
    init_file = os.path.join(rendezvous, "rendezvous")
    worker_config = json.dumps({**dataclasses.asdict(config), "load_progress": False})
    procs = [subprocess.Popen([sys.executable, "-m", "k3.engine.tensor_parallel", str(rank), str(world), init_file,
                               worker_config])
             for rank in range(1, world)]
    platform = select_platform(config.platform)
    device = torch.device(platform.info.device)

    def shutdown():
        if not dist.is_initialized():
            return
        _send(None, device)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        dist.destroy_process_group()
        shutil.rmtree(rendezvous, ignore_errors=True)

    try:
        engine = _init(0, world, init_file, config, platform, on_shutdown=shutdown,
                       broadcast=lambda meta, copies: _send(meta, device, copies))
    except BaseException:
        for p in procs:
            p.kill()
        shutil.rmtree(rendezvous, ignore_errors=True)
        raise
    atexit.register(shutdown)
    return engine


if __name__ == "__main__":
    rank_arg, world_arg, init_arg, config_arg = sys.argv[1:5]
    _worker(int(rank_arg), int(world_arg), init_arg, EngineConfig(**json.loads(config_arg)))
