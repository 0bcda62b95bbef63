"""The amd plugin's kernel tables (k3.platforms.amd.kernels, each kernel bound to gfx942's or
gfx950's launch options from k3.platforms.amd.archs) run on an NVIDIA GPU against the reference:
every conformance item of every served entry (full tier, float64 left out: kernels hand it to
the reference op), or with --models the model cases (tiny models end to end on those tables). This checks the AMD launch configurations' numerics on real hardware (tile
sizes, IEEE dots where gfx950 has no tf32, the MoE modes including `dot_scaled`), never AMD code
generation (bench/amdgcn_report.py compiles for AMD) nor AMD hardware.

Base platform: nvidia on a CUDA GPU (its other entries stay), the reference on the CPU (then
Triton needs TRITON_INTERPRET=1: a tiny trial, `-k` to pick cases).

Run: python3 bench/amd_tables_cuda.py --out $OUT/amd_tables_cuda.json [--arch gfx950] [-k mla]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import torch


def served_kernels(platform, arch: str):
    """`platform.kernels` with every entry the amd plugin serves replaced by its `arch`-bound kernel;
    the replaced entry names."""
    from k3.platforms._probe import has_module
    from k3.platforms.amd import archs, kernels

    target, replaced, tables = archs.arch(arch), [], {}
    for family in ("kda", "mla", "indexer", "moe", "attn_res", "elementwise"):
        entries = kernels.table_entries(family, target, has_module)
        tables[family] = dataclasses.replace(getattr(platform.kernels, family), **entries)
        replaced += [f"{family}.{e}" for e in entries]
    return dataclasses.replace(platform.kernels, **tables), replaced


def run(arch: str, pattern: str | None, platform_name: str, models: bool = False) -> dict:
    import pytest                                    # the cases decline through pytest.skip

    from k3.conformance.registry import items
    from k3.conformance.runner import RunContext, run_item
    from k3.platform import select_platform

    platform = select_platform(platform_name)
    platform.kernels, replaced = served_kernels(platform, arch)
    rows = []
    for item in items("full"):
        wanted = item.case.family == "model" if models else item.case.entry in replaced
        if not wanted or item.dtype == "float64" or (pattern and pattern not in item.id):
            continue
        missing = [r for r in item.requirements(platform.capabilities) if not platform.capabilities.has(r)]
        if missing:
            rows.append({"id": item.id, "skipped": f"requires {missing}"})
            continue
        start = time.perf_counter()
        try:
            outcome = run_item(RunContext(platform), item)
            worst = outcome.worst()
            rows.append({"id": item.id, "passed": outcome.passed, "seconds": round(time.perf_counter() - start, 2),
                         "worst": worst.to_dict() if worst else None})
        except pytest.skip.Exception as e:     # the case declines on this platform (e.g. a refused mode)
            rows.append({"id": item.id, "skipped": str(e)[:400]})
        except Exception as e:                 # a kernel that raises is a failure of this row
            rows.append({"id": item.id, "passed": False, "error": f"{type(e).__name__}: {e}"[:400]})
    ran = [r for r in rows if "passed" in r]
    return {"arch": arch, "entries": replaced, "passed": sum(r["passed"] for r in ran),
            "failed": [r["id"] for r in ran if not r["passed"]], "skipped": len(rows) - len(ran), "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", choices=("gfx942", "gfx950"), help="default: both")
    parser.add_argument("-k", dest="pattern", default=None, help="only items whose id contains this")
    parser.add_argument("--models", action="store_true", help="the model cases (tiny models end to end) instead")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    platform_name = "nvidia" if torch.cuda.is_available() else "reference"
    results = [run(arch, args.pattern, platform_name, args.models) for arch in args.arch or ["gfx942", "gfx950"]]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (Triton interpreter)"
    out = {"bench": "amd_tables_cuda", "date": datetime.date.today().isoformat(), "device": device,
           "platform": platform_name, "torch": torch.__version__, "results": results}
    for r in results:
        print(f"{r['arch']}: {r['passed']} passed, {len(r['failed'])} failed, {r['skipped']} skipped; "
              f"failed: {r['failed']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
