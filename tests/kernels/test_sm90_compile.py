"""Every Triton kernel k3 launches compiles for the H200 (sm_90a) at K3's shapes, here, without a
GPU: Triton lowers it to PTX and the ptxas in Triton's wheel assembles it. This catches what the
interpreter cannot (layouts, dot shapes, types) before any device time is spent. Runs
`bench/ptxas_report.py --json` in a process of its own, since this tier's interpreter mode
would turn the kernels into interpreted functions."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "ptxas_report.py"
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not os.access(PTXAS, os.X_OK), reason="this Triton wheel ships no ptxas (Linux x86_64 has one)")
def test_every_kernel_compiles_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    assert {r["kernel"] for r in rows} == {"kda_decode", "kda_recurrent", "short_conv", "moe_gate_up", "moe_down",
                                            "router", "attn_res", "mla_decode", "indexer_decode",
                                            "indexer_decode_mxfp4", "indexer_prefill", "rms_norm", "glu", "moe_dequant",
                                            "kda_chunked_recurrence", "kda_intra_chunk", "moe_sum_choices",
                                            "mla_merge", "moe_half_planes"}
    for r in rows:
        assert 0 < r["registers"] <= 255, r
    # the column-blocked KDA decode tiles are the spill-free variants the H200 bench compares
    spills = {r["variant"]: r["spill_bytes"] for r in rows if r["kernel"] == "kda_decode"}
    assert spills["w4_statefirst1_bv32"] == 0 and spills["w4_statefirst1_bv16"] == 0
    # the MoE tiles the H200 serves by default (moe_mxfp4.launch_options) and the verify recurrence
    compiled = {(r["kernel"], r["variant"]): r["spill_bytes"] for r in rows}
    for kernel in ("moe_gate_up", "moe_down"):
        assert {(kernel, "dot_scaled_n64_k128_t16"), (kernel, "dot_scaled_n128_k64_t16")} <= set(compiled)
    assert compiled[("moe_down", "dot_scaled_n128_k64_t16")] == 0
    assert compiled[("moe_dequant", "bf16_L3584")] == 0
    for tile in ("gemv_n32_k512_w4_s1_u4", "gemv_n32_k512_w4_s1_u4_fp16x2_c4"):    # the gemv tile served, and its
        assert compiled[("moe_gate_up", tile)] == 0 and compiled[("moe_down", tile)] == 0   # fp16x2 form (legacy)
    assert compiled[("kda_recurrent", "verify_states_u_bv32")] == 0
    assert compiled[("kda_chunked_recurrence", "C64_K128_bv32_w8")] == 0        # the launched tile: no spills
    assert compiled[("kda_intra_chunk", "C64_K128_w4_s16_d16")] <= 64             # the launched tile: 24 B
    assert compiled[("kda_intra_chunk", "mma_C64_K128_w4_s64_tf32x3")] == 0       # the mma form: 224 registers
    # the served recurrence storing o to the token rows: 255 registers, 264 B spilled (2026-12-06; the
    # whole prefill still 1.09x faster than with the scatter after it, BENCHMARKS.md)
    assert compiled[("kda_chunked_recurrence", "mma_rows_C64_K128_bv32_w4_tf32x3")] <= 264
    assert compiled[("indexer_prefill", "k3.1_Hi32_D128_fp32_keys")] == 0
    assert compiled[("indexer_decode_mxfp4", "k3.1_Hi32_D128_page64")] == 0      # the MXFP4 key pages' tile
    assert all(compiled[("rms_norm", f"bf16_D{d}")] == 0 for d in (7168, 3584, 1536, 512))
    assert compiled[("glu", "bf16_situ_I1536")] == 0
    assert compiled[("attn_res", "boundary_nvis8_d4096_w8")] == 0                  # the decode launch


CENSUS = SCRIPT.parent / "moe_sass_census.py"
CUOBJDUMP = PTXAS.parent / "cuobjdump"


@pytest.mark.skipif(not (os.access(PTXAS, os.X_OK) and os.access(CUOBJDUMP, os.X_OK)),
                    reason="this Triton wheel ships no ptxas / cuobjdump (Linux x86_64 has both)")
def test_the_bf16_decode_ptx_loop_issues_fewer_instructions_than_dot_scaled(tmp_path):
    """decode_bf16's PTX decode exists to issue fewer instructions a weight than dot_scaled's
    upcast (issue 27): the sm_90a SASS census of the MoE k-loop keeps it so (a Triton layout
    that splits the two-byte packs again, or a lost fold, shows here before any device time)."""
    out = tmp_path / "census.json"
    done = subprocess.run([sys.executable, str(CENSUS), "--out", str(out)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=600, cwd=CENSUS.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["form"], r["tile"]): r for r in json.loads(out.read_text())["rows"]}
    served = rows[("dot_scaled", "n128_t16_k64_w8_s3")]["instructions_a_weight"]
    ptx = rows[("decode_bf16 ptx", "n128_t16_k64_w8_s3")]["instructions_a_weight"]
    folded = rows[("decode_bf16 folded ptx", "n128_t16_k64_w8_s3")]["instructions_a_weight"]
    assert folded < ptx < 0.8 * served, (folded, ptx, served)
    assert all(r["loop_instructions"] > 100 for r in rows.values())       # the loop was found
