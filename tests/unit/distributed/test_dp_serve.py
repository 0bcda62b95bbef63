"""`k3 serve` with data-parallel attention on the CPU (gloo): the same greedy tokens as one
process through the OpenAI API, two "nodes" on 127.0.0.1 with one API server, clean shutdown,
and a killed rank ending the whole deployment (float64 k3-tiny)."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from serving import Serve, greedy, health


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


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "dp2xtp2"])
def test_data_parallel_serves_the_same_tokens(checkpoint, expected, tp):
    server = Serve(checkpoint, "--data-parallel-size", "2", "--tensor-parallel-size", str(tp))
    try:
        url = server.url()
        assert sorted(server.pids()) == list(range(1, 2 * tp))
        assert greedy(url) == expected and all(len(tokens) == 8 for tokens in expected)
        assert health(url) == 200
    finally:
        code = server.stop()
    assert code == 0, server.log          # SIGTERM stops every rank cleanly
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
