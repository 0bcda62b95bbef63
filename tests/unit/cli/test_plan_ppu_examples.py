"""docs/planning.md's PPU deployments (seed-notes "Platforms": 810E two nodes TP32 / EP32, M890
four nodes TP8 / DP4 / EP32) run as written through `k3 plan --json`: each fits, on the
topology its comment names."""

import json
import re
import shlex
from pathlib import Path

from k3.cli.main import main

DOC = Path(__file__).resolve().parents[3] / "docs" / "planning.md"


def _examples() -> list[list[str]]:
    block = re.search(r"<!-- ppu-plans: begin -->(.*?)<!-- ppu-plans: end -->", DOC.read_text(), re.S).group(1)
    return [shlex.split(line)[1:] for line in block.splitlines() if line.startswith("k3 plan ")]


def test_ppu_plan_examples_fit_on_their_topologies(capsys):
    examples = _examples()
    assert len(examples) == 2
    want = [(32, 1, 32, 2), (8, 4, 32, 4)]                       # TP, DP, EP, nodes: 810E, M890
    for argv, (tp, dp, ep, nodes) in zip(examples, want):
        assert main([*argv, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        got = (out["tensor_parallel_size"], out["data_parallel_size"], out["expert_parallel_size"], out["nnodes"])
        assert got == (tp, dp, ep, nodes) and out["world_size"] == 32 and out["fits"], out
        assert out["capacity_tokens"] > 0 and out["weight_terms"]["experts_per_rank"] == 896 // 32
