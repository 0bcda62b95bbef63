"""The Triton kernels the amd plugin serves compile for AMD Instinct targets, here, without ROCm or
a GPU: Triton's AMD backend runs TTIR -> TTGIR -> LLIR -> AMDGCN -> hsaco from what pip installs
(LLVM's AMDGPU target and lld are linked into libtriton). Runs `bench/amdgcn_report.py --json` in
a process of its own (this tier's interpreter mode would turn the kernels into interpreted
functions). CI's time budget (all variants of both targets take ~2 CPU minutes) allows a few launched
variants: gfx950's native-MXFP4 dot_scaled MoE tile, the indexer decode scores on both fp8
flavours (OCP E4M3FN pages on gfx950, FNUZ on gfx942, IEEE dots on gfx950, XF32 on gfx942) and
over MXFP4 key pages on gfx950, and gfx950's MLA decode tile (16 positions a step: no spill);
`python3 bench/amdgcn_report.py` compiles all 88 variants of both targets
(docs/amd.md has its table, bench/results/amdgcn-report-2026-12-04.json the rows).
Compile-checked only: nothing here executes AMD code."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.amd.compiler", reason="this Triton wheel has no AMD backend")
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "amdgcn_report.py"
GFX950 = ("moe_gate_up/dot_scaled_n128_k64_t16", "indexer_decode", "indexer_decode_mxfp4",
          "mla_decode/kvbf16_native_n16")
GFX942 = ("indexer_decode",)


def test_served_kernels_compile_to_hsaco_for_gfx942_and_gfx950(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", "--subset", "--jobs", "2",
                           "--kernels", "gfx950=" + ",".join(GFX950), "--kernels", "gfx942=" + ",".join(GFX942)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["arch"], r["kernel"], r["variant"]): r for r in json.loads(done.stdout)}
    assert {(a, k) for a, k, _ in rows} == ({("gfx950", s.split("/")[0]) for s in GFX950}
                                          | {("gfx942", s.split("/")[0]) for s in GFX942})
    for key, r in rows.items():
        assert r["error"] is None and r["stage"] == "hsaco" and r["hsaco_bytes"] > 0, (key, r)
        assert 0 < r["vgprs"] <= 512 and r["sgprs"] > 0 and r["launched"], (key, r)
    # the served tiles compile without spills (the register report's numbers, docs/amd.md)
    for r in rows.values():
        assert r["vgpr_spills"] == 0 and r["scratch_bytes"] == 0 and r["occupancy_waves"] >= 2, r
