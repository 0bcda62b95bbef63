"""Starting, joining and watching the ranks of a deployment.

Three ways in (docs/distributed.md):

- `start_rank0(config, dcfg)`: the caller (`k3 serve` on node 0, or `k3.LLM`) becomes global
  rank 0. Unless torchrun started it, it launches the node's other ranks with
  `torch.distributed.elastic.multiprocessing.start_processes` (what torchrun's agent uses; each
  rank a fresh `python -m k3.engine.distributed.worker`, so the caller's main module is never
  re-imported), joins the env:// rendezvous (MASTER_ADDR / MASTER_PORT: rank 0 hosts the TCP
  store) and returns the `DistributedEngine`. A monitor thread polls the local ranks: one that
  exits non-zero is one log line naming it, then the deployment stops.
- `run_node(config, dcfg)`: `k3 serve --node-rank R` for R > 0: the node's agent. It starts the
  node's ranks the same way and waits; the first rank that fails is one log line, the others
  are terminated and the agent exits 1 (ranks elsewhere then fail their next collective).
- `run_rank(config, dcfg, rank)`: one non-zero rank's life, in a launched worker or in a
  process torchrun started (`k3 serve` under torchrun joins as $RANK; only rank 0 serves HTTP).

Every collective has the timeout `dcfg.timeout_s`, and rank 0 exchanges a heartbeat at least
every `dcfg.heartbeat_interval`, so a rank that dies on another node ends the deployment within
the timeout instead of hanging it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist

from k3.log import get_logger

from ..config import EngineConfig
from .config import DistributedConfig, DistributedError, torchrun_rank
from .dp_frontend import DistributedEngine, lead
from .groups import build_parallel_context, idle_forward, init_groups, init_world
from .tp import TPSender, follow

logger = get_logger(__name__)

WORKER_MODULE = "k3.engine.distributed.worker"
STOP_GRACE_S = 15.0      # a rank torchrun started waits this long after SIGTERM for rank 0's stop
FAILURE_GRACE_S = 2.0     # a failed server keeps answering /health with 503 this long before it exits


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _describe_exit(rank: int, pid: int, exitcode: int) -> str:
    how = (f"was killed by signal {signal.Signals(-exitcode).name}" if exitcode < 0
           else f"exited with code {exitcode}")
    return f"k3: rank {rank} (pid {pid}) {how}; stopping the deployment"


# ---------------------------------------------------------------------------------- joining


def check(config: EngineConfig, dcfg: DistributedConfig) -> None:
    """Refuse a layout or option no rank can run, before any process starts (ValueError)."""
    from k3.config import K3Config

    config.validate()
    dcfg.validate(num_experts=K3Config.from_pretrained(config.model, config.hf_overrides).num_experts
                  if dcfg.enable_expert_parallel else None)
    if dcfg.enable_expert_parallel:
        # the DP ranks run the MoE collectives in lockstep, one forward per step each
        if config.speculative_config:
            raise ValueError("expert parallelism does not run with speculative decoding yet (a step of it runs "
                             "several forwards; the DP ranks' MoE collectives need one per step)")
        if config.async_scheduling:
            raise ValueError("expert parallelism does not run with async_scheduling yet (lookahead steps launch "
                             "forwards ahead; the DP ranks' MoE collectives need one per step)")


def _join(config: EngineConfig, dcfg: DistributedConfig, rank: int):
    """Join the rendezvous as `rank`, build the groups and this rank's engine; the startup
    check that every rank agrees on the cache layout."""
    from k3.platform import select_platform

    from ..engine import LLMEngine

    platform = select_platform(config.platform)
    if config.kv_transfer_config is not None:       # each rank's own control channel (kv_port + rank)
        from ..kv_transfer.config import for_rank

        config = dataclasses.replace(config, kv_transfer_config=for_rank(config.kv_transfer_config, rank))
    if dcfg.enable_expert_parallel and config.async_scheduling is None:
        config = dataclasses.replace(config, async_scheduling=False)      # one forward per step (check)
    device = torch.device(platform.info.device)
    if device.type == "cuda" and device.index is None and torch.cuda.device_count() > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % dcfg.nproc_per_node)) % torch.cuda.device_count())
    backend = platform.capabilities.dist_backend
    init_world(dcfg, rank, backend)
    groups = init_groups(dcfg, rank, backend)
    sender = TPSender(groups.tp, device, groups.tp_size)
    engine = LLMEngine(config, platform=platform, parallel=build_parallel_context(platform, groups, dcfg),
                       broadcast=sender.step if groups.is_tp_leader and groups.tp_size > 1 else None)
    if engine.media is not None and groups.tp_size > 1:
        _split_encoder(engine, config, groups, sender)
    ep = engine.model.parallel.ep
    if ep is not None:
        start, count = engine.model.parallel.expert_shard(engine.model.cfg.num_experts)
        logger.info(f"rank {rank} holds experts {start}-{start + count - 1} of {engine.model.cfg.num_experts} "
                    f"(expert parallel over {ep.size} ranks)")
    if engine.kv_producer is not None or engine.kv_consumer is not None:
        from ..kv_transfer.ranks import share_endpoints

        share_endpoints(engine, groups)             # a TP leader learns its followers' transfer endpoints
    layouts: list = [None] * dcfg.world_size
    dist.all_gather_object(layouts, (groups.dp_rank, engine.pool.num_rows, engine.max_model_len), group=groups.control)
    for r, (d, rows, max_len) in enumerate(layouts):
        if d == groups.dp_rank and rows != engine.pool.num_rows:
            raise DistributedError(f"tensor-parallel ranks of DP rank {d} sized their caches differently "
                                   f"({rows} vs {engine.pool.num_rows} rows): give every rank the same memory")
        if max_len != layouts[0][2]:
            raise DistributedError(f"rank {r} has a context limit of {max_len} tokens, rank 0 {layouts[0][2]}: "
                                   "give every rank the same memory and --max-model-len")
    return engine, groups, sender


def _split_encoder(engine, config: EngineConfig, groups, sender: TPSender) -> None:
    """The vision encoder over the TP ranks (k3.vision.tensor_parallel): in "weights" mode each
    rank keeps its shard of the tower; the leader's encoder runs go through `sender.encode`."""
    from k3.vision.tensor_parallel import encoder_tp_mode, shard_tower

    media = engine.media
    media.tp_mode = encoder_tp_mode(config.mm_encoder_tp_mode, media.tower.cfg, groups.tp_size)
    if media.tp_mode == "weights":
        shard_tower(media.tower, groups.tp_rank, groups.tp_size, engine.model.parallel.collectives.all_reduce)
    if groups.is_tp_leader:
        tower, mode = media.tower, media.tp_mode
        media.encode_fn = lambda patches, grids: sender.encode(tower, patches, grids, mode)


def run_rank(config: EngineConfig, dcfg: DistributedConfig, rank: int) -> int:
    """One non-zero rank until rank 0 stops the deployment (0), or its failure (1, after one
    log line naming it)."""
    if not _watch_launcher(rank):
        _defer_stop_signals(rank, min(STOP_GRACE_S, dcfg.timeout_s))
    try:
        engine, groups, sender = _join(config, dcfg, rank)
        if groups.is_tp_leader:
            lead(engine, groups, dcfg, sender)
        else:
            follow(engine, groups.tp, lambda: idle_forward(engine.model, dcfg))
        dist.destroy_process_group()
        return 0
    except BaseException as e:
        traceback.print_exc()
        logger.error(f"rank {rank} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        os._exit(1)         # never wait in a process group's destructor for peers that are gone


def _defer_stop_signals(rank: int, grace: float) -> None:
    """A rank that another launcher (torchrun) started: SIGTERM / SIGINT reach every rank at
    once, so wait up to `grace` seconds for rank 0's stop (a clean shutdown, exit 0) before
    exiting 1 with one line."""
    def on_signal(signum, frame):
        name = signal.Signals(signum).name

        def later():
            time.sleep(grace)
            logger.error(f"rank {rank}: {name} and no stop from rank 0 within {grace:g} s; exiting")
            os._exit(1)

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        threading.Thread(target=later, name="k3-stop-grace", daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def _watch_launcher(rank: int) -> bool:
    """A launched rank exits when the process that started it is gone (killed without a
    chance to stop its children). False when k3 did not launch this rank."""
    launcher = os.environ.get("K3_LAUNCHER_PID")
    if not launcher:
        return False

    def watch():
        while True:
            if os.getppid() != int(launcher):
                logger.error(f"rank {rank}: its launcher (pid {launcher}) is gone; exiting")
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="k3-launcher-watch", daemon=True).start()
    return True


# ---------------------------------------------------------------------------------- launching


def _start_local(config: EngineConfig, dcfg: DistributedConfig, ranks: list[int], log_dir: str):
    """Start `ranks` of this node as workers through torch's elastic multiprocessing."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    base = dcfg.node_rank * dcfg.nproc_per_node
    payload = (json.dumps({**dataclasses.asdict(config), "load_progress": False}), json.dumps(dcfg.to_json_dict()))
    args = {i: ("-m", WORKER_MODULE, *payload) for i in range(len(ranks))}
    envs = {i: {"RANK": str(r), "LOCAL_RANK": str(r - base), "WORLD_SIZE": str(dcfg.world_size),
                "LOCAL_WORLD_SIZE": str(dcfg.nproc_per_node), "GROUP_RANK": str(dcfg.node_rank),
                "MASTER_ADDR": dcfg.master_addr, "MASTER_PORT": str(dcfg.master_port),
                "K3_LAUNCHER_PID": str(os.getpid())}
            for i, r in enumerate(ranks)}
    context = start_processes(name="k3", entrypoint=sys.executable, args=args, envs=envs,
                              logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.NONE, tee=Std.NONE))
    pids = context.pids()
    logger.info(f"node {dcfg.node_rank} of {dcfg.nnodes} started " + ", ".join(f"rank {r} (pid {pids[i]})"
                                                                             for i, r in enumerate(ranks))
                + f"; rendezvous {dcfg.master_addr}:{dcfg.master_port}")
    return context


class _Monitor:
    """Polls the local ranks; the first that exits non-zero (outside shutdown) calls on_failure
    with one line naming it."""

    def __init__(self, context, ranks: list[int], on_failure):
        self.context, self.ranks, self.on_failure = context, ranks, on_failure
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="k3-rank-monitor", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pids = self.context.pids()
        while not self.stopping.wait(0.2):
            for i, handler in self.context.subprocess_handlers.items():
                code = handler.proc.poll()
                if code is not None and code != 0 and not self.stopping.is_set():
                    self.on_failure(_describe_exit(self.ranks[i], pids[i], code))
                    return


def _set_rendezvous(dcfg: DistributedConfig) -> DistributedConfig:
    if dcfg.master_port is None:
        dcfg = dataclasses.replace(dcfg, master_port=free_port(dcfg.master_addr))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = dcfg.master_addr, str(dcfg.master_port)
    return dcfg


def start_rank0(config: EngineConfig, dcfg: DistributedConfig, *, exit_on_failure: bool = False) -> DistributedEngine:
    """Launch this node's other ranks (unless torchrun did), join as global rank 0 and return
    the DistributedEngine. exit_on_failure (the server): a failed rank ends this process with
    exit code 1 after FAILURE_GRACE_S (so /health answers 503 meanwhile); otherwise (k3.LLM) the
    next step raises DistributedError."""
    check(config, dcfg)
    under_torchrun = torchrun_rank()
    if under_torchrun is not None:
        rank, world = under_torchrun
        if rank != 0 or world != dcfg.world_size:
            raise DistributedError(f"torchrun started rank {rank} of {world}, but data_parallel_size x "
                                   f"tensor_parallel_size is {dcfg.world_size} and only rank 0 runs the engine")
        dcfg = dataclasses.replace(dcfg, master_addr=os.environ["MASTER_ADDR"],
                                   master_port=int(os.environ["MASTER_PORT"]))
    else:
        dcfg = _set_rendezvous(dcfg)
    ranks = [] if under_torchrun else [r for r in dcfg.node_ranks(0) if r != 0]
    log_dir = tempfile.mkdtemp(prefix="k3-ranks-")
    context = _start_local(config, dcfg, ranks, log_dir) if ranks else None
    front: list[DistributedEngine] = []
    failed = threading.Event()

    def reap(timeout: float = 30) -> None:
        if context is not None:
            monitor.stopping.set()
            deadline = time.monotonic() + timeout
            while context.wait(0) is None and time.monotonic() < deadline:
                time.sleep(0.1)
            context.close(timeout=5)
        shutil.rmtree(log_dir, ignore_errors=True)

    def on_failure(message: str) -> None:
        if failed.is_set():
            return
        failed.set()
        if front:
            front[0].fail(message)       # logs it; the next step raises
        else:
            logger.error(message.removeprefix("k3: "))
        if exit_on_failure:
            def finish():
                time.sleep(FAILURE_GRACE_S)
                if context is not None:
                    monitor.stopping.set()
                    context.close(timeout=5)
                shutil.rmtree(log_dir, ignore_errors=True)
                os._exit(1)

            threading.Thread(target=finish, name="k3-failure-exit", daemon=True).start()

    monitor = _Monitor(context, ranks, on_failure) if context is not None else None
    try:
        engine, groups, sender = _join(config, dcfg, 0)
    except BaseException:
        if context is not None:
            monitor.stopping.set()
            context.close(timeout=5)
        shutil.rmtree(log_dir, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise

    def cleanup() -> None:
        reap()
        if dist.is_initialized() and not failed.is_set():
            dist.destroy_process_group()

    front.append(DistributedEngine(engine, groups, dcfg, sender, on_shutdown=cleanup,
                                   on_failure=on_failure))
    return front[0]


def run_node(config: EngineConfig, dcfg: DistributedConfig) -> int:
    """The agent of node R > 0: start its ranks, wait; 0 when they all stopped cleanly, 1 (and
    one line naming the first failed rank) otherwise. SIGINT / SIGTERM stop its ranks."""
    check(config, dcfg)
    ranks = list(dcfg.node_ranks())
    log_dir = tempfile.mkdtemp(prefix="k3-ranks-")
    context = _start_local(config, dcfg, ranks, log_dir)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    pids = context.pids()
    try:
        while True:
            for i, handler in context.subprocess_handlers.items():
                code = handler.proc.poll()
                if code is not None and code != 0:
                    logger.error(_describe_exit(ranks[i], pids[i], code).removeprefix("k3: "))
                    context.close(timeout=5)
                    return 1
            if all(h.proc.poll() == 0 for h in context.subprocess_handlers.values()):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        logger.info(f"node {dcfg.node_rank} stopped by a signal; stopping its ranks")
        context.close(timeout=5)
        return 1
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
