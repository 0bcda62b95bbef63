"""Disaggregation under tensor (and data) parallelism: every rank's transfer endpoint, and the
consumer's pulls into its TP followers' caches (docs/disaggregation.md).

Every rank of a PD deployment runs a transfer backend with its own cache registered (a TP
follower's producer serves reads of its shard; its consumer serves `pull`). At start-up
`share_endpoints` gathers every rank's (control, data, base) over the control group, and each
TP leader (the DP rank's engine, which owns the producer's pins and the consumer's pulls)
keeps those of its TP ranks: a producer names them in its handles, a consumer sends each
follower the reads of its shard as one `pull` call on the follower's control channel while it
reads its own. A follower serves a pull in its control thread, never past its deadline, so
when the leader's call returns the follower writes no more (rows are freed only after that).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .plan import Read
from .wire import TransferError, WireClient

PULL_OP = "pull"


@dataclass(frozen=True)
class RankEndpoint:
    """One rank's transfer endpoint: its control channel, data plane, registered cache base."""

    control: str
    data: str
    base: int


def endpoint_of(role) -> RankEndpoint:
    """The endpoint of a KVProducer or KVConsumer (its backend and registered base)."""
    return RankEndpoint(role.backend.control, role.backend.data, role.base)


def share_endpoints(engine, groups) -> None:
    """Gather every rank's endpoint (a collective over `groups.control`: every rank calls it)
    and give the TP leader's producer and consumer those of its TP ranks, in TP order."""
    import torch.distributed as dist

    role = engine.kv_producer or engine.kv_consumer
    if role is None:
        return
    mine = (groups.dp_rank, groups.tp_rank, endpoint_of(role))
    everyone: list = [None] * groups.world_size
    dist.all_gather_object(everyone, mine, group=groups.control)
    ranks = [ep for _, _, ep in sorted((e for e in everyone if e[0] == groups.dp_rank), key=lambda e: e[1])]
    if groups.is_tp_leader:
        for part in (engine.kv_producer, engine.kv_consumer):
            if part is not None:
                part.ranks = ranks


def serve_pulls(backend, timeout_s: float) -> None:
    """Answer a TP leader's `pull` calls on `backend`'s control channel: the reads it lists,
    into this rank's registered cache, none started past `timeout_s` after the call arrived."""
    def pull(header: dict, _: bytes):
        deadline = time.monotonic() + timeout_s
        for peer, remote, local, nbytes in header["reads"]:
            if time.monotonic() > deadline:
                raise TransferError(f"pull past its {timeout_s:g} s deadline")
            backend.read(str(peer), int(remote), int(local), int(nbytes))
        return {"ok": True}, b""

    backend.serve(PULL_OP, pull)


class RankPulls:
    """A TP leader's side: run every rank's reads of one request (its own here, each follower's
    through one `pull` call), concurrently; TransferError when any rank's failed."""

    def __init__(self, backend, timeout_s: float, max_inflight: int):
        self.backend = backend
        # a follower stops starting reads after timeout_s; one read may take timeout_s more
        self.client = WireClient(2 * timeout_s + 5)
        self.timeout_s = timeout_s
        self._calls: ThreadPoolExecutor | None = None
        self._max_workers = max_inflight

    def run(self, ranks: list[RankEndpoint], reads: list[list[Read]]) -> None:
        """reads[r]: TP rank r's reads (rank 0: this leader)."""
        futures = []
        if len(reads) > 1:
            if self._calls is None:
                self._calls = ThreadPoolExecutor(max_workers=self._max_workers * (len(reads) - 1),
                                                 thread_name_prefix="k3-kv-rank-pull")
            futures = [self._calls.submit(self._remote, ranks[r].control, reads[r]) for r in range(1, len(reads))]
        error = None
        try:
            for read in reads[0]:
                self.backend.read(read.peer, read.remote, read.local, read.nbytes)
        except Exception as e:  # noqa: BLE001 - the followers' calls are waited for all the same
            error = e
        for r, future in enumerate(futures, start=1):
            try:
                future.result()
            except Exception as e:  # noqa: BLE001
                error = error or TransferError(f"TP rank {r}: {e}")
        if error is not None:
            raise error

    def _remote(self, control: str, reads: list[Read]) -> None:
        self.client.call(control, {"op": PULL_OP, "reads": [[r.peer, r.remote, r.local, r.nbytes] for r in reads]})

    def close(self) -> None:
        if self._calls is not None:
            self._calls.shutdown(wait=False, cancel_futures=True)
        self.client.close()


__all__ = ["RankEndpoint", "RankPulls", "endpoint_of", "serve_pulls", "share_endpoints"]
