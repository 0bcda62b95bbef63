"""`k3 bench serve`'s numbers against hand-computed ones (vLLM's definitions), its prompts and
arrival gaps."""

import statistics

import pytest

from k3.cli.bench_client import RequestOutput, arrival_gaps
from k3.cli.bench_metrics import benchmark_result, format_report
from k3.cli.bench_prompts import given_prompts, random_prompts


def test_metrics_match_a_hand_computation():
    outputs = [RequestOutput(success=True, prompt_len=10, output_tokens=5, ttft=0.1, itl=[0.02, 0.02, 0.03, 0.03],
                             latency=0.2),
               RequestOutput(success=True, prompt_len=20, output_tokens=3, ttft=0.3, itl=[0.05, 0.05], latency=0.4),
               RequestOutput(success=True, prompt_len=5, output_tokens=1, ttft=0.05, latency=0.05),
               RequestOutput(success=False, prompt_len=7, error="HTTP 500: boom")]
    r = benchmark_result(outputs, 2.0, metric_percentiles=(50.0, 99.9))
    assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (3, 1, 35, 9)
    assert r["output_lens"] == [5, 3, 1, 0] and r["input_lens"] == [10, 20, 5, 7]
    assert (r["request_throughput"], r["output_throughput"], r["total_token_throughput"]) == (1.5, 4.5, 22.0)
    ttft = [100.0, 300.0, 50.0]
    assert r["mean_ttft_ms"] == pytest.approx(statistics.fmean(ttft))
    assert r["median_ttft_ms"] == pytest.approx(100.0)
    assert r["std_ttft_ms"] == pytest.approx(statistics.pstdev(ttft))
    tpot = [(200 - 100) / 4, (400 - 300) / 2]                    # the one-token request has no TPOT
    assert r["mean_tpot_ms"] == pytest.approx(statistics.fmean(tpot))
    itl = [20.0, 20.0, 30.0, 30.0, 50.0, 50.0]
    assert r["mean_itl_ms"] == pytest.approx(statistics.fmean(itl)) and r["median_itl_ms"] == pytest.approx(30.0)
    assert r["p99.9_itl_ms"] == pytest.approx(50.0, abs=1e-6) and r["p50_e2el_ms"] == pytest.approx(200.0)
    assert r["errors"][3] == "HTTP 500: boom"
    text = format_report(r, metric_percentiles=(50.0, 99.9))
    assert "Successful requests:                    3" in text and "P99.9 ITL (ms):" in text


def test_prompts_and_arrivals():
    a = random_prompts(3, 8, 4, range_ratio=0.5, vocab_size=100, seed=1)
    assert a == random_prompts(3, 8, 4, range_ratio=0.5, vocab_size=100, seed=1)
    assert all(4 <= len(p.prompt) <= 12 and p.prompt_len == len(p.prompt) and 2 <= p.output_len <= 6 for p in a)
    assert all(0 <= t < 100 for p in a for t in p.prompt)
    assert [len(p.prompt.split()) for p in random_prompts(2, 5, 1, as_text=True)] == [5, 5]
    assert [p.prompt for p in given_prompts(3, 2, prompts=["x", "y"])] == ["x", "y", "x"]
    assert arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    gaps = arrival_gaps(4000, 10.0, 1.0, 0)
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.05)       # Poisson: mean 1 / rate
