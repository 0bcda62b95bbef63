"""The Triton kernels the amd plugin serves compile for AMD Instinct targets, here, without ROCm or
a GPU: Triton's AMD backend runs TTIR -> TTGIR -> LLIR -> AMDGCN -> hsaco from what pip installs
(LLVM's AMDGPU target and lld are linked into libtriton). Runs `bench/amdgcn_report.py --json` in
a process of its own (this tier's interpreter mode would turn the kernels into interpreted
functions). Every variant the plugin launches (`--subset`: 63 over both targets, about 20 s on
two cores) compiles here, each checked for a binary, registers and no spills; `python3
bench/amdgcn_report.py` compiles all 88 variants, launched or not (docs/amd.md has its table,
bench/results/amdgcn-report-2026-12-04.json the rows).
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
SERVED = {"attn_res", "glu", "indexer_decode", "indexer_decode_mxfp4", "indexer_prefill", "kda_chunked_recurrence",
          "kda_decode", "kda_intra_chunk", "kda_recurrent", "mla_decode", "mla_merge", "moe_dequant", "moe_down",
          "moe_gate_up", "rms_norm", "router", "short_conv"}


def test_served_kernels_compile_to_hsaco_for_gfx942_and_gfx950(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", "--subset", "--jobs", "2"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["arch"], r["kernel"], r["variant"]): r for r in json.loads(done.stdout)}
    assert {(a, k) for a, k, _ in rows} == {(a, k) for a in ("gfx942", "gfx950") for k in SERVED}
    assert ("gfx950", "moe_gate_up", "dot_scaled_n128_k64_t16") in rows     # native MXFP4 operands on gfx950
    for key, r in rows.items():
        assert r["error"] is None and r["stage"] == "hsaco" and r["hsaco_bytes"] > 0, (key, r)
        assert 0 < r["vgprs"] <= 512 and r["sgprs"] > 0 and r["launched"], (key, r)
    # the served tiles compile without spills (the register report's numbers, docs/amd.md)
    for r in rows.values():
        assert r["vgpr_spills"] == 0 and r["scratch_bytes"] == 0 and r["occupancy_waves"] >= 2, r
