"""`k3 serve` with data-parallel attention on the CPU (gloo): the same greedy tokens as one
process through the OpenAI API, two "nodes" on 127.0.0.1 with one API server, clean shutdown,
and a killed rank ending the whole deployment (float64 k3-tiny)."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time

import pytest

from serving import K3, Serve, greedy, health


@pytest.fixture(scope="module")
def expected(checkpoint):
    """The greedy tokens of one process."""
    one = Serve(checkpoint)
    try:
        return greedy(one.url())
    finally:
        assert one.stop() == 0, one.log


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("tp, extra", [(1, ()), (2, ()), (1, ("--enable-expert-parallel",)),
                                       (2, ("--enable-expert-parallel",))],
                         ids=["dp2", "dp2xtp2", "dp2xep2", "dp2xtp2xep4"])
def test_data_parallel_serves_the_same_tokens(checkpoint, expected, tp, extra):
    server = Serve(checkpoint, "--data-parallel-size", "2", "--tensor-parallel-size", str(tp), *extra)
    try:
        url = server.url()
        assert sorted(server.pids()) == list(range(1, 2 * tp))
        assert greedy(url) == expected and all(len(tokens) == 8 for tokens in expected)
        assert health(url) == 200
        if extra:       # the 8 experts in contiguous blocks over the DP x TP ranks
            ranks = 2 * tp
            held = sorted((int(r), int(a), int(b)) for line in server.lines for r, a, b in
                          re.findall(r"rank (\d+) holds experts (\d+)-(\d+) of 8 \(expert parallel over "
                                     + str(ranks), line))
            n = 8 // ranks
            assert held == [(r, r * n, r * n + n - 1) for r in range(ranks)], server.log
    finally:
        code = server.stop()
    assert code == 0, server.log          # SIGTERM stops every rank cleanly
    assert "failed" not in server.log, server.log


def test_an_idle_deployment_outlives_the_timeout(checkpoint, expected):
    """Rank 0's heartbeat keeps idle ranks inside the collective timeout (without it DP rank 1
    would fail its wait for the next step after 8 s)."""
    server = Serve(checkpoint, "--data-parallel-size", "2", timeout=8)
    try:
        url = server.url()
        time.sleep(10)
        assert health(url) == 200 and server.proc.poll() is None, server.log
        assert greedy(url) == expected
    finally:
        code = server.stop()
    assert code == 0, server.log


def test_under_torchrun_rank0_serves_and_the_others_join(checkpoint, expected):
    """`torchrun --nproc-per-node 2 ... k3 serve --data-parallel-size 2`: each process joins as
    $RANK, k3 launches nothing, only rank 0 serves HTTP."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                "127.0.0.1", "--master-port", str(_free_port()), "--no-python", *K3]
    server = Serve(checkpoint, "--data-parallel-size", "2", command=torchrun)
    try:
        url = server.url()
        assert greedy(url) == expected
        assert not any("started rank" in line for line in server.lines), server.log
        assert sum("serving" in line for line in server.lines) == 1
    finally:
        server.stop()
    assert "failed" not in server.log, server.log


def test_two_nodes_one_server_and_a_killed_rank_ends_the_deployment(checkpoint, expected):
    flags = ("--data-parallel-size", "2", "--tensor-parallel-size", "2", "--nnodes", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(_free_port()))
    node1 = Serve(checkpoint, *flags, "--node-rank", "1", timeout=20)
    node0 = Serve(checkpoint, *flags, "--node-rank", "0", timeout=20)
    try:
        url = node0.url()
        assert sorted(node0.pids()) == [1] and sorted(node1.pids()) == [2, 3]
        assert greedy(url) == expected
        assert not any("serving" in line for line in node1.lines)       # one API server, on node 0
        os.kill(node1.pids()[3], signal.SIGKILL)
        deadline = time.monotonic() + 20                                # the collective timeout
        while time.monotonic() < deadline and (node0.proc.poll() is None or node1.proc.poll() is None):
            time.sleep(0.2)
        assert node0.proc.poll() is not None and node1.proc.poll() is not None, "the deployment hangs"
    finally:
        codes = node0.stop(), node1.stop()
    assert codes[0] != 0 and codes[1] != 0, (codes, node0.log, node1.log)
    assert "k3: rank 3 (pid" in node1.log and "killed by signal SIGKILL; stopping the deployment" in node1.log
    assert "k3: the distributed step failed" in node0.log, node0.log


def test_a_killed_local_rank_fails_health_then_exits(checkpoint):
    server = Serve(checkpoint, "--data-parallel-size", "2", timeout=20)
    try:
        url = server.url()
        os.kill(server.pids()[1], signal.SIGKILL)
        deadline = time.monotonic() + 20
        seen = set()
        while time.monotonic() < deadline and server.proc.poll() is None:
            try:
                seen.add(health(url))
            except OSError:
                pass
            time.sleep(0.1)
        assert server.proc.poll() is not None, "the deployment hangs"
    finally:
        code = server.stop()
    assert code == 1, server.log
    assert 503 in seen, seen
    assert "k3: rank 1 (pid" in server.log and "killed by signal SIGKILL" in server.log, server.log
