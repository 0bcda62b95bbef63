"""The end-to-end benchmark runs its smoke mode (k3-tiny, CPU reference platform) and reports
every figure, so the H200 session does not find a broken script."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _smoke(script: str, tmp_path, *extra: str) -> dict:
    """Run bench/`script` --smoke (and `extra` arguments) and return the JSON it wrote."""
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


def test_k3_slice_bench_smoke(tmp_path):
    result = _smoke("k3_slice.py", tmp_path)
    main, peer = result["reference"], result["ppu"]
    assert [d["concurrency"] for d in main["decode"]] == [1, 3] and all(d["tokens_per_s"] > 0 for d in main["decode"])
    assert set(main) >= {"ttft_ms", "prefix_ttft_ms_caching_on", "prefix_ttft_ms_caching_off",
                         "single_decode_tokens_per_s_plain", "single_decode_tokens_per_s_ngram", "workload"}
    assert main["workload"]["output_tokens_per_s"] > 0 and main["workload"]["mean_tpot_ms"] > 0
    assert [d["concurrency"] for d in main["decode_async"]] == [1, 3] and main["decode_async_lookahead_steps"] > 0
    assert [d["concurrency"] for d in peer["decode"]] == [1] and "prefix_ttft_ms_caching_on" not in peer


def test_k3_slice_profile_smoke(tmp_path):
    result = _smoke("k3_slice_profile.py", tmp_path)
    assert result["kernels"] and result["kernel_us_per_step"] > 0
    assert any("linear" in r["kernel"] or "mm" in r["kernel"] for r in result["kernels"])
    modules = {r["module"] for r in result["stacks"]}
    assert any(m.startswith("model.layers.*.") for m in modules), modules   # ops placed on their layer parts


def test_k3_slice_prefill_profile_smoke(tmp_path):
    result = _smoke("k3_slice_profile.py", tmp_path, "--prefill", "48")
    assert result["prefill_tokens"] == 48 and result["steps"] == 1 and result["kernel_us_per_step"] > 0
    assert any(r["module"].startswith("model.layers.*.") for r in result["stacks"])


def test_host_syncs_smoke(tmp_path):
    """The CPU reports no synchronising call (torch's sync debug mode is CUDA's); the runs and
    their lookahead counts are what the GPU run fills in."""
    result = _smoke("host_syncs.py", tmp_path)
    runs = {r["async_scheduling"]: r for r in result["runs"]}
    assert set(runs) == {False, True} and all(r["step_ms"] > 0 and r["syncs_per_step"] == {} for r in runs.values())
    assert runs[True]["lookahead_steps"] > 0 and runs[False]["lookahead_steps"] == 0


def test_every_device_session_phase_fits_one_call():
    """bench/h200_session.sh: each phase's step time limits add up to under the device's 10
    minutes a call, so no phase can be cut off whole by the call's own limit."""
    import re

    text = (ROOT / "bench" / "h200_session.sh").read_text()
    body = text[text.index('case $phase in'):]
    phases = re.findall(r"^([\w-]+)\)\n(.*?)\n\s*;;", body, flags=re.S | re.M)
    assert {name for name, _ in phases} == {"conformance", "kernels", "prefill", "e2e", "profile", "check",
                                            "tune", "vision", "collectives", "amd", "company", "moe-grouped",
                                            "moe-bf16", "moe-tiled", "moe-bf16-e2e", "kda-mma", "kda-split", "columns",
                                            "profile64"}
    calls = {"moe-grouped": 2}      # documented as two calls (ONLY= names the second half)
    for name, steps in phases:
        limits = [int(s) for s in re.findall(r"^\s*step [\w-]+ (\d+) ", steps, flags=re.M)]
        assert limits and sum(limits) < 600 * calls.get(name, 1), (name, limits)


def test_company_probe_smoke(tmp_path):
    """The probe parts a prompt's computation alone vs in a crowd: on the reference platform the
    crowd changes nothing; with the router input nudged one ulp the logits move (the control)."""
    still = _smoke("company_probe.py", tmp_path)
    assert len(still["probes"]) == 2 and all(p["first_routing_flip"] is None and p["first_split_step"] is None
                                             for p in still["probes"])
    assert all(s["rel_logit_diff"] == 0.0 for p in still["probes"] for s in p["steps"])
    nudged = _smoke("company_probe.py", tmp_path, "--perturb-router")
    assert nudged["perturb_router"] and any(s["rel_logit_diff"] > 0 for p in nudged["probes"] for s in p["steps"])


def test_bf16_batch_company_smoke(tmp_path):
    """Alone vs in a crowd, before and after (K3_LEGACY_ROUNDING): every run reports its splits."""
    result = _smoke("bf16_batch_company.py", tmp_path)
    assert [(r["rounding"], r["of"]) for r in result["runs"]] == [("after", 3), ("before", 3)]
    assert all("error" not in r and r["differing"] == len(r["splits"]) <= 3 for r in result["runs"])


def test_batch_invariant_device_step_fits_one_call():
    """bench/batch_invariant_h200.sh: its step limits add up to under the device's 10 minutes."""
    import re

    text = (ROOT / "bench" / "batch_invariant_h200.sh").read_text()
    limits = [int(s) for s in re.findall(r"^step [\w-]+ (\d+) ", text, flags=re.M)]
    assert len(limits) == 4 and sum(limits) < 600, limits


def test_batch_invariant_companions_smoke(tmp_path):
    """The served log-probs of one sequence, alone and beside two companions, and its prefill
    recompute: equal bit for bit on the reference platform (the script the H200 step runs)."""
    result = _smoke("batch_invariant_companions.py", tmp_path, "--dtype", "float32")
    assert result["all_equal"] and set(result["verdicts"]) == {"batch_3_equals_batch_1",
                                                               "prefill_recompute_equals_served"}
    assert len(result["runs"]["1"]["logprobs"]) == 3 and result["recomputed_logprobs"] == result["runs"]["1"]["logprobs"]


def test_ep_all_to_all_smoke(tmp_path):
    """2 gloo ranks: both dispatch variants return every row to its token through its expert
    (bf16 rounding only) and every figure is reported."""
    result = _smoke("ep_all_to_all.py", tmp_path)
    assert result["world"] == 2 and result["backend"] == "gloo"
    assert [r["tokens_per_rank"] for r in result["rows"]] == [1, 4]
    for r in result["rows"]:
        assert 0 < r["exact_error_ratio"] < 1e-2 and 0 < r["static_error_ratio"] < 1e-2
        assert all(r[k] > 0 for k in ("exact_ms", "static_ms", "raw_a2a_ms", "tp_all_reduce_ms", "raw_a2a_GBps"))


def test_token_sharded_prefill_smoke(tmp_path):
    """2 gloo ranks, float64: the sharded prefill's last logits equal the unsharded one's, the
    bytes gathered match the count from the shapes, and every time is reported."""
    result = _smoke("token_sharded_prefill.py", tmp_path)
    assert result["world"] == 2 and [r["length"] for r in result["rows"]] == [40]
    for r in result["rows"]:
        assert r["max_abs_logit_diff"] < 1e-9 and r["unsharded_ms"] > 0 and r["sharded_ms"] > 0
        assert r["token_bytes_per_token"] == r["model_token_bytes_per_token"] > 0
        assert r["piece_bytes"] == r["model_piece_bytes"] > 0


def test_token_sharded_prefill_tp_smoke(tmp_path):
    """--tp: the heads <-> tokens variant against the TP prefill, the all-to-all bytes as counted."""
    result = _smoke("token_sharded_prefill.py", tmp_path, "--tp")
    assert result["tp"] and result["world"] == 2
    for r in result["rows"]:
        assert r["max_abs_logit_diff"] < 1e-9 and r["tp_unsharded_ms"] > 0 and r["sharded_ms"] > 0
        assert r["all_to_all_bytes_per_token"] == r["model_all_to_all_bytes_per_token"] > 0


def test_dcp_decode_smoke(tmp_path):
    """DCP = 1 and 2 (gloo): each rank stores its share of the records (the planner's bytes
    per token / DCP, up to the odd token) and both decode the same greedy tokens."""
    result = _smoke("dcp_decode.py", tmp_path)
    one, two = result["runs"]
    assert (one["dcp"], two["dcp"]) == (1, 2) and one["decode_step_ms"] > 0 and two["decode_step_ms"] > 0
    assert one["stored_bytes_per_token_per_rank"] == result["planner_bytes_per_token"]
    tokens = result["context"] + result["steps"]
    per_record = result["planner_bytes_per_token"]
    assert two["stored_bytes_per_token_per_rank"] == per_record * ((tokens + 1) // 2) / tokens
    assert two["topk_calls"] > 0 and two["tokens_equal_dcp1"]
    topk = result["wire"]["topk"]
    assert {r["scores"] for r in result["wire"]["rows"]} == {"normal", "allequal", "halfequal"}
    for row in result["wire"]["rows"]:        # one-word candidates: round 1 moves half the bytes
        assert 2 * row["round1_packed_bytes"] == row["round1_lossless_bytes"] == row["candidates"] * 8
        if row["scores"] == "normal":
            assert row["total_packed_bytes"] < row["total_lossless_bytes"]
        else:                                 # the tie worst case: every row takes every round, bounded
            assert row["tie_rows"] == row["rows"]
            assert row["total_packed_bytes"] <= row["candidates"] * 4 + topk * 4 + topk * 8


def test_vision_encoder_bench_smoke(tmp_path):
    rows = _smoke("vision_encoder.py", tmp_path)["rows"]
    assert [r["tower"] for r in rows] == ["k3-tiny-vision"]
    assert rows[0]["image_tokens"] == 16 and rows[0]["encoder_ms_per_image"] > 0 and rows[0]["ratio"] > 0


def test_vision_ttft_bench_smoke(tmp_path):
    """One image request against the same prompt without it: every case has a TTFT, the image
    prompt is longer by the image's tokens less its placeholder, and the encoder ran once."""
    r = _smoke("vision_ttft.py", tmp_path)
    assert r["image_tokens"] == 16 and r["encoder_runs"] == 1
    tokens = r["prompt_tokens"]
    assert tokens["image"] == tokens["same_length"] == tokens["text"] + 16     # the placeholder expanded to 16
    assert all(r["ttft_p50_ms"][k] > 0 and r["cpu_ms_p50"][k] > 0 for k in ("image", "text", "same_length"))


def test_vision_ttft_bench_dummy_smoke(tmp_path):
    """The path k3-slice takes (config alone, random weights drawn on the device, no tokenizer:
    a synthetic prompt with the placeholder in the middle), at k3-tiny's size."""
    r = _smoke("vision_ttft.py", tmp_path, "--dummy", "--text-tokens", "24")
    assert r["prompt"] == "synthetic ids" and r["encoder_runs"] == 1
    assert r["prompt_tokens"] == {"image": 24 + 16, "text": 24, "same_length": 24 + 16}


def test_vision_serve_check_on_the_cpu(tmp_path):
    """The device script's image-chat step (bench/vision_serve_check.py) passes every check on the
    reference platform: k3 serve, the OpenAI client, an image chat, the cached prefix, /metrics,
    a 400 for a truncated image."""
    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "vision_serve_check.py"), "--platform", "reference",
                           "--dtype", "float32", "--side", "112", "--max-tokens", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["image_tokens"] == 16 and all(report["checks"].values()) and len(report["checks"]) == 6


def test_ppu_backend_quick(tmp_path):
    """bench/ppu_backend.py --quick (k3-tiny on the CPU): every MoE kernel row agrees with the
    reference table's output, and the ppu and naive engines report their figures."""
    out = tmp_path / "ppu.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "ppu_backend.py"), "--quick", "--variants", "ppu",
                           "naive", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["moe"]["rows"]
    assert {r["kernel"] for r in rows} == {"reference_table", "ppu_cache", "ppu_cache_slots", "ppu_mxfp4_host",
                                           "ppu_mxfp4_device", "naive"}
    assert all("error" not in r and r["ms"] > 0 and r["error_ratio_vs_reference_table"] < 1e-5 and r["ok"]
               for r in rows)
    assert [d["concurrency"] for d in result["ppu"]["decode"]] == [1, 2] and result["ppu"]["ttft_ms"]
    assert result["naive"]["decode"][0]["note"].startswith("naive") and result["summary"]["speedup_vs_naive"]


def test_ppu_profile_smoke(tmp_path):
    """bench/ppu_profile.py --smoke: a decode step of 2 requests and a short prefill, each with its
    kernel and calling-module tables, the routed experts held dense (--expert-cache on)."""
    out = tmp_path / "prof.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "ppu_profile.py"), "--smoke", "--expert-cache", "on",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["expert_cache"]["on"]
    for section in ("decode_2", "prefill_16"):
        assert result[section]["kernels"] and result[section]["kernel_us_per_step"] > 0, section
        assert any(r["module"].startswith("model.layers.*.block_sparse_moe") for r in result[section]["stacks"])


def test_structured_output_bench_smoke(tmp_path):
    """bench/structured_output.py with llguidance under n-gram speculation (bench/structured_h200.sh's
    `guidance` and `ngram` steps): both kinds decode, the speculation counters are reported."""
    result = _smoke("structured_output.py", tmp_path, "--backend", "guidance", "--speculative-config",
                    '{"method": "ngram", "num_speculative_tokens": 2}')
    row = result["rows"][0]
    assert result["backend"] == "guidance" and row["free_tokens_per_s"] > 0 and row["constrained_tokens_per_s"] > 0
    assert set(row["spec_constrained"]) >= {"verify_steps", "draft_tokens", "grammar_refused_drafts"}


def test_ppu_dequant_smoke(tmp_path):
    """bench/ppu_dequant.py on the CPU: each form checked bit for bit before its row is written."""
    result = _smoke("ppu_dequant.py", tmp_path, "--experts", "1", "2")
    forms = {(r["matrix"], r["experts"], r["form"]) for r in result["rows"]}
    eager = ("eager_table", "decode_eager", "bits_eager", "stack_eager", "table_copy_eager")
    assert forms == {(m, g, f) for m in ("w13", "w2") for g in (1, 2) for f in eager}
    assert all(r["exact"] and r["ms"] > 0 for r in result["rows"])
