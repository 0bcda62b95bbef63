"""Distributed-tier fixtures: one k3-tiny checkpoint; helpers start `k3 serve` processes."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from k3.cli.checkpoint import init_checkpoint

    return init_checkpoint("k3-tiny", tmp_path_factory.mktemp("dist-k3-tiny"), progress=False)
