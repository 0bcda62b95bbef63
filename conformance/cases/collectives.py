"""Collectives: the platform's `collectives()` (its ordered backends, torch.distributed last)
against plain torch.distributed, in 2 processes on the platform's dist backend (gloo on the
CPU; on GPUs they need two devices, `multi_device`, and the report's provider names the backend
that served each item, e.g. the NVIDIA plugin's symmetric-memory ones under
K3_NVIDIA_SYMM_MEM=1). Every item of a session runs in one launch of the two workers (`launch`); all_gather
and all_to_all_single (expert-parallel dispatch, against the rows each rank must receive) must
be exact, all_reduce within the dtype's tolerance (summation order may differ), and every
rank must get the same sum.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from .. import compare as cmp
from ..registry import Case, Sample, register

WORLD = 2
TIMEOUT_S = 300


def _requires(capabilities):
    """Two processes share the CPU under gloo; any other backend needs two devices."""
    return () if capabilities.dist_backend == "gloo" else ("multi_device",)


def spec(item) -> dict:
    """What a worker needs to run one item."""
    return {"id": item.id, "op": item.case.entry.split(".")[1], "dtype": item.dtype, "seed": item.seed,
            **item.sample.params}


def launch(platform_name: str, items: list, workdir: Path) -> list[dict]:
    """Run the items on WORLD worker processes; returns each rank's results, or raises
    RuntimeError naming the rank that failed or timed out."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "items.json").write_text(json.dumps([spec(i) for i in items]))
    rendezvous = workdir / "rendezvous"            # torch's file store: a fresh file per launch
    rendezvous.unlink(missing_ok=True)
    init = f"file://{rendezvous}"
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    procs = [subprocess.Popen([sys.executable, "-m", "k3.conformance.dist_worker", "--platform", platform_name,
                               "--rank", str(r), "--world", str(WORLD), "--init", init,
                               "--items", str(workdir / "items.json"), "--out", str(workdir)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
             for r in range(WORLD)]
    problems = []
    for r, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"collectives worker rank {r} timed out after {TIMEOUT_S} s") from None
        if proc.returncode:
            problems.append(f"rank {r} exited {proc.returncode}: {out.strip()[-2000:]}")
    if problems:
        raise RuntimeError("collectives workers failed: " + " | ".join(problems))
    return [torch.load(workdir / f"rank{r}.pt") for r in range(WORLD)]


def check(item, ranks: list[dict]) -> tuple[cmp.Outcome, str]:
    """Compare one item's results on every rank; returns (outcome, provider)."""
    outcome, provider = cmp.Outcome(), "unknown"
    tol = item.case.tolerance(item.dtype) if item.case.entry.endswith("all_reduce") else None
    for r, results in enumerate(ranks):
        res = results.get(item.id, {"error": "no result"})
        if "error" in res:
            outcome.outputs.append(cmp.OutputResult(f"rank{r}", "error", False, message=res["error"]))
            continue
        provider = res["provider"]
        got, want = res["got"], res["want"]
        wrong = cmp.dtype_check(f"rank{r}", got, want.dtype)
        if wrong:
            outcome.outputs.append(wrong)
        elif tol is None:
            outcome.outputs.append(cmp.exact(f"rank{r}", got, want))
        else:
            outcome.outputs.append(cmp.close(f"rank{r}", got, want, tol))
    if tol is not None and all("got" in res.get(item.id, {}) for res in ranks):
        first = ranks[0][item.id]["got"]
        for r in range(1, len(ranks)):
            outcome.outputs.append(cmp.exact(f"rank{r}_equals_rank0", ranks[r][item.id]["got"], first))
    return outcome, provider


register(Case(
    "collectives.all_reduce", "collectives", "collectives.all_reduce", requires_for=_requires,
    samples=(Sample("2ranks_T33_D65", params={"shape": [33, 65]}),
             Sample("2ranks_T1_D7168", params={"shape": [1, 7168]}),
             Sample("2ranks_B2_T5_D64", params={"shape": [2, 5, 64]})),
    doc="Sum over ranks: the platform's backend against torch.distributed."))

register(Case(
    "collectives.all_gather", "collectives", "collectives.all_gather", requires_for=_requires,
    samples=(Sample("2ranks_T33_D65_dim0", params={"shape": [33, 65], "dim": 0}),
             Sample("2ranks_T9_D64_dim-1", params={"shape": [9, 64], "dim": -1}),
             Sample("2ranks_B2_T3_D16_dim1", params={"shape": [2, 3, 16], "dim": 1}),
             Sample("2ranks_T8_D7168_dim0", params={"shape": [8, 7168], "dim": 0})),       # decode-sized
    doc="Concatenation in rank order: exact."))

register(Case(
    "collectives.all_to_all_single", "collectives", "collectives.all_to_all_single", requires_for=_requires,
    samples=(Sample("2ranks_N8_D64_equal", params={"rows": 8, "row_shape": [64]}),
             Sample("2ranks_splits3-5_0-7_D65", params={"splits": [[3, 5], [0, 7]], "row_shape": [65]}),
             Sample("2ranks_splits0-0_2-0_D16_device_splits",
                    params={"splits": [[0, 0], [2, 0]], "row_shape": [16], "device_splits": True}),
             Sample("2ranks_splits1-0_0-1_D7168", params={"splits": [[1, 0], [0, 1]], "row_shape": [7168]})),
    doc="Rows cut per destination rank, received pieces in rank order (EP dispatch): exact."))
