"""Data-parallel attention: one scheduler and cache per DP rank, one engine to the server.

Global rank 0 is DP rank 0's TP leader and runs `DistributedEngine`, which the async engine and
the server (or `k3.LLM`) use like an LLMEngine. Each DP rank's TP leader runs its own LLMEngine;
those of DP ranks 1..D-1 run `lead`. Once per step, rank 0 and the DP leaders exchange over the
gloo DP-leaders group:

1. rank 0 broadcasts the commands (`broadcast_object_list`): per DP rank the new requests
   assigned to it and the aborts of its requests, whether any DP rank has work this step (with
   expert parallelism the idle ones then run an empty forward that joins the MoE collectives),
   or stop;
2. every leader applies its commands and steps its engine (which broadcasts the forward to its
   TP followers), runs an empty forward, or sends its followers a heartbeat;
3. all leaders gather (`all_gather_object`) their step's outputs, their load (running, waiting,
   free cache rows: `LLMEngine.snapshot`) and whether they still have work.

A new request goes to the least-loaded DP rank (`pick_rank`: fewest running + waiting
requests, then most free cache rows, then the lowest rank). While nobody has work a heartbeat
thread on rank 0 runs an empty exchange every `heartbeat_interval` seconds (well under the
collective timeout), so idle ranks do not time out and a dead one is noticed.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from k3.log import get_logger

from .config import DistributedConfig, DistributedError
from .groups import Groups, idle_forward
from .tp import TPSender

logger = get_logger(__name__)


def pick_rank(loads: list[dict]) -> int:
    """The DP rank for a new request: fewest running + waiting requests (including those
    assigned but not yet reported), then most free cache rows, then the lowest rank."""
    return min(range(len(loads)), key=lambda d: (loads[d]["running"] + loads[d]["waiting"],
                                                 -loads[d]["cache_rows_free"], d))


def merge_snapshots(snapshots: list[dict]) -> dict:
    """One snapshot over DP ranks: integer counters and gauges summed, anything else (a mean,
    a list) DP rank 0's; plus `data_parallel_size` and the per-rank running/waiting counts."""
    merged = dict(snapshots[0])
    for key, value in snapshots[0].items():
        if isinstance(value, int) and not isinstance(value, bool):
            merged[key] = sum(s.get(key, 0) for s in snapshots)
    merged["data_parallel_size"] = len(snapshots)
    merged["data_parallel_requests"] = [s["running"] + s["waiting"] for s in snapshots]
    merged["data_parallel_requests_total"] = [s.get("requests_total", 0) for s in snapshots]
    return merged


def _local_step(engine, sender: TPSender, cfg: DistributedConfig, anyone_has_work: bool) -> list:
    """One DP rank's part of a step: its engine's step when it has work; else an empty forward
    (expert parallelism, another rank has work) or a heartbeat to its TP followers.

    With expert parallelism every DP rank must run exactly one forward in a step in which any
    runs one (the MoE collectives span all ranks): a rank whose step scheduled nothing (its
    requests wait for cache rows) runs the empty forward too, and one that ran several (a kind
    of step `launch.check` refuses with expert parallelism) is an error, not a deadlock."""
    if engine.has_unfinished_requests():
        before = engine.runner.num_forwards
        outputs = engine.step()
        ran = engine.runner.num_forwards - before
        if cfg.enable_expert_parallel and ran > 1:
            raise DistributedError(f"DP rank step ran {ran} forwards; expert parallelism needs one per step")
        if ran:
            return outputs         # (a step that scheduled nothing heartbeats its TP followers below)
    else:
        outputs = []
    forward = anyone_has_work and cfg.enable_expert_parallel
    if forward:
        idle_forward(engine.model, cfg)
    sender.idle(forward=forward)
    return outputs


class DistributedEngine:
    """Rank 0's engine over every DP rank, with the LLMEngine interface the server and k3.LLM
    use: add_request, abort_request, has_unfinished_requests, step, snapshot, stats,
    prefix_cache_stats, spec_stats, shutdown, tokenizer, config, model_config, max_model_len.

    engine: rank 0's own LLMEngine (DP rank 0); groups, cfg: the deployment; sender: rank 0's
    sender to its TP followers; on_shutdown: the launcher's clean-up (wait for and reap the
    local ranks, destroy the process group); on_failure: called once with the one-line reason
    when a collective fails or a rank dies (the server's launcher ends the process)."""

    def __init__(self, engine, groups: Groups, cfg: DistributedConfig, sender: TPSender, *, on_shutdown=None,
                 on_failure=None):
        self.engine, self.groups, self.cfg, self.sender = engine, groups, cfg, sender
        self._on_shutdown, self._on_failure = on_shutdown, on_failure
        self.dp_size = groups.dp_size
        self._adds: list[list] = [[] for _ in range(self.dp_size)]
        self._aborts: list[list] = [[] for _ in range(self.dp_size)]
        self._owner: dict[str, int] = {}                       # request id -> DP rank
        self._reports: list[dict] = [{"snapshot": engine.snapshot(), "has_work": False}
                                     for _ in range(self.dp_size)]
        self._lock = threading.RLock()
        self._last_exchange = time.monotonic()
        self.failed: str | None = None
        self._stopped = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="k3-dp-heartbeat", daemon=True)
        self._heartbeat.start()

    # ------------------------------------------------------------------ what the server reads
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.config

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def device(self):
        return self.engine.device

    @property
    def model(self):
        return self.engine.model

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt, params=None, multi_modal_data=None) -> None:
        """Check the request on rank 0 (every DP rank has the same context limit and vocabulary)
        and assign it to the least-loaded DP rank; ValueError when refused. multi_modal_data:
        its images (`LLMEngine.add_request`), sent to the rank that serves it."""
        from ..params import SamplingParams

        params = params or SamplingParams()
        with self._lock:
            self._raise_if_failed()
            if request_id in self._owner:
                raise ValueError(f"request id {request_id!r} is already in use")
            ids = self.engine.outputs.check(prompt, params)
            if multi_modal_data:
                self.engine.outputs.check(self.engine.outputs.prepare_media(ids, multi_modal_data)[0], params)
            d = pick_rank(self._loads())
            if d == 0:
                self.engine.add_request(request_id, prompt, params, multi_modal_data)
            else:
                self._adds[d].append((request_id, prompt, params, multi_modal_data))
            self._owner[request_id] = d

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            d = self._owner.pop(request_id, None)
            if d == 0:
                self.engine.abort_request(request_id)
            elif d is not None:
                if any(a[0] == request_id for a in self._adds[d]):
                    self._adds[d] = [a for a in self._adds[d] if a[0] != request_id]
                else:
                    self._aborts[d].append(request_id)

    def has_unfinished_requests(self) -> bool:
        return (self.failed is not None or self.engine.has_unfinished_requests()
                or any(r["has_work"] for r in self._reports[1:]) or any(self._adds) or any(self._aborts))

    # ------------------------------------------------------------------ stepping
    def step(self) -> list:
        """One step of every DP rank; the outputs of every request that progressed anywhere."""
        with self._lock:
            self._raise_if_failed()
            try:
                return self._exchange()
            except Exception as e:
                self._fail(f"k3: the distributed step failed (a rank died or a collective timed out after "
                           f"{self.cfg.timeout_s:g} s): {type(e).__name__}: {e}")
                raise DistributedError(self.failed) from e

    def _exchange(self) -> list:
        self._last_exchange = time.monotonic()
        if self.dp_size == 1:
            return _local_step(self.engine, self.sender, self.cfg, False)
        anyone = self.has_unfinished_requests()
        commands = {"stop": False, "work": anyone, "adds": self._adds, "aborts": self._aborts}
        box = [commands]
        dist.broadcast_object_list(box, group=self.groups.dp_leaders, group_src=0)
        self._adds = [[] for _ in range(self.dp_size)]
        self._aborts = [[] for _ in range(self.dp_size)]
        outputs = _local_step(self.engine, self.sender, self.cfg, anyone)
        reports: list = [None] * self.dp_size
        dist.all_gather_object(reports, {"outputs": [], "snapshot": self.engine.snapshot(),
                                         "has_work": self.engine.has_unfinished_requests(), "refused": []},
                               group=self.groups.dp_leaders)
        for d, report in enumerate(reports):
            if d:
                outputs.extend(report["outputs"])
            if report["refused"]:
                raise DistributedError(f"DP rank {d} refused requests rank 0 accepted: {report['refused']}")
        self._reports = reports
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def _loads(self) -> list[dict]:
        loads = [dict(r["snapshot"]) for r in self._reports]
        loads[0] = self.engine.snapshot()
        for d in range(1, self.dp_size):
            loads[d]["waiting"] += len(self._adds[d])
        return loads

    def _beat(self) -> None:
        """Rank 0's heartbeat: an empty exchange whenever no step ran for heartbeat_interval."""
        interval = self.cfg.heartbeat_interval
        while not self._stopped.wait(interval / 4):
            if time.monotonic() - self._last_exchange < interval or self.failed:
                continue
            if not self._lock.acquire(timeout=interval / 4):
                continue
            try:
                # only when nothing is pending: a step with work belongs to its caller (its outputs)
                if (not self._stopped.is_set() and not self.failed and not self.has_unfinished_requests()
                        and time.monotonic() - self._last_exchange >= interval):
                    self.step()
            except DistributedError:
                pass
            finally:
                self._lock.release()

    # ------------------------------------------------------------------ state and counters
    def snapshot(self) -> dict:
        """Counters and load summed over DP ranks (`merge_snapshots`)."""
        with self._lock:
            snaps = [r["snapshot"] for r in self._reports]
            snaps[0] = self.engine.snapshot()
            return merge_snapshots(snaps)

    @property
    def stats(self) -> dict:
        snap = self.snapshot()
        return {k: snap[k] for k in self.engine.stats}

    def prefix_cache_stats(self) -> dict:
        snap = self.snapshot()
        return {k: snap[k] for k in self.engine.prefix_cache_stats()}

    def spec_stats(self) -> dict:
        snap = self.snapshot()
        return {k: snap[k] for k in self.engine.spec_stats()}

    # ------------------------------------------------------------------ failure and shutdown
    def _raise_if_failed(self) -> None:
        if self.failed:
            raise DistributedError(self.failed)

    def _fail(self, message: str) -> None:
        if self.failed:
            return
        self.failed = message
        logger.error(message.removeprefix("k3: "))
        if self._on_failure is not None:
            self._on_failure(message)

    def fail(self, message: str) -> None:
        """Mark the deployment failed (a rank died): the next step raises; `message` is logged."""
        self._fail(message)

    def shutdown(self) -> None:
        """Stop every rank (a stop command through the DP leaders and TP groups), then the
        launcher's clean-up. After a failure only the clean-up runs."""
        self._stopped.set()
        acquired = self._lock.acquire(timeout=self.cfg.timeout_s)
        try:
            if not self.failed and acquired:
                try:
                    if self.dp_size > 1:
                        dist.broadcast_object_list([{"stop": True}], group=self.groups.dp_leaders, group_src=0)
                    self.sender.stop()
                except Exception as e:
                    logger.error(f"stopping the other ranks failed: {type(e).__name__}: {e}")
        finally:
            if acquired:
                self._lock.release()
            if self._on_shutdown is not None:
                self._on_shutdown()


def lead(engine, groups: Groups, cfg: DistributedConfig, sender: TPSender) -> None:
    """The loop of the TP leader of DP rank d > 0: apply rank 0's commands, step, report; until
    stop. A request it refuses is reported (rank 0 checked it with the same limits, so this is a
    configuration mismatch and ends the deployment)."""
    d = groups.dp_rank
    while True:
        box = [None]
        dist.broadcast_object_list(box, group=groups.dp_leaders, group_src=0)
        commands = box[0]
        if commands["stop"]:
            sender.stop()
            return
        for request_id in commands["aborts"][d]:
            engine.abort_request(request_id)
        refused = []
        for request_id, prompt, params, multi_modal_data in commands["adds"][d]:
            try:
                engine.add_request(request_id, prompt, params, multi_modal_data)
            except ValueError as e:
                refused.append((request_id, str(e)))
        outputs = _local_step(engine, sender, cfg, commands["work"])
        dist.all_gather_object([None] * groups.dp_size,
                               {"outputs": outputs, "snapshot": engine.snapshot(),
                                "has_work": engine.has_unfinished_requests(), "refused": refused},
                               group=groups.dp_leaders)
