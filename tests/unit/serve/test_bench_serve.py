"""`k3 bench serve` against the in-process k3-tiny server: the saved JSON (vLLM's field names)
counts what was sent, the server's token counts and the timings agree with each other."""

import json

import pytest

from k3.cli.main import main

from serve_support import MODEL


def _bench(*argv: str) -> int:
    return main(["bench", "serve", "--disable-tqdm", *argv])


def test_completions_with_concurrency_saves_vllm_json(server, tmp_path, capsys):
    code = _bench("--base-url", server.url, "--model", MODEL, "--num-prompts", "4", "--random-input-len", "6",
                  "--random-output-len", "3", "--max-concurrency", "2", "--ignore-eos", "--metric-percentiles", "50,99",
                  "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json")
    assert code == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert (r["backend"], r["model_id"], r["num_prompts"], r["request_rate"], r["max_concurrency"]) == \
        ("openai", MODEL, 4, "inf", 2)
    assert (r["completed"], r["failed"], r["errors"]) == (4, 0, [""] * 4)
    assert r["input_lens"] == [6] * 4 and r["total_input_tokens"] == 24      # the server's usage.prompt_tokens
    assert r["output_lens"] == [3] * 4 and r["total_output_tokens"] == 12    # ignore_eos: max_tokens each
    assert r["request_throughput"] == pytest.approx(4 / r["duration"])
    assert r["total_token_throughput"] == pytest.approx(36 / r["duration"])
    for ttft, itls in zip(r["ttfts"], r["itls"]):
        assert 0 < ttft <= r["duration"] and all(t >= 0 for t in itls)
    assert r["p99_ttft_ms"] <= max(r["ttfts"]) * 1000 + 1e-6
    middle = sorted(t * 1000 for t in r["ttfts"])[1:3]
    assert r["median_ttft_ms"] == pytest.approx(sum(middle) / 2)       # the median of 4: the middle two's mean
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms", f"p50_{metric}_ms",
                f"p99_{metric}_ms"} <= r.keys()
    assert r["mean_e2el_ms"] >= r["mean_ttft_ms"]
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Successful requests:" in out and "P99 TTFT (ms):" in out


def test_chat_given_prompts_at_a_rate_default_model_and_filename(server, tmp_path):
    code = _bench("--base-url", server.url, "--backend", "openai-chat", "--dataset-name", "custom", "--prompt", "Hi",
                  "--prompt", "Hello there", "--num-prompts", "3", "--custom-output-len", "2", "--ignore-eos",
                  "--request-rate", "50", "--save-result", "--result-dir", str(tmp_path))
    assert code == 0
    (path,) = tmp_path.glob("*.json")
    assert path.name.startswith(f"openai-chat-50.0qps-{MODEL}-")     # the model: the first of /v1/models
    r = json.loads(path.read_text())
    assert (r["completed"], r["failed"], r["output_lens"], r["request_rate"]) == (3, 0, [2, 2, 2], 50.0)
    assert r["input_lens"][0] == r["input_lens"][2] != r["input_lens"][1]     # prompts cycle: Hi, Hello there, Hi


def test_failed_requests_are_counted_and_exit_1(server, tmp_path, capsys):
    code = _bench("--base-url", server.url, "--model", "no-such-model", "--num-prompts", "2", "--random-input-len",
                  "4", "--random-output-len", "2", "--save-result", "--result-dir", str(tmp_path),
                  "--result-filename", "r.json")
    assert code == 1
    r = json.loads((tmp_path / "r.json").read_text())
    assert (r["completed"], r["failed"]) == (0, 2) and all(e.startswith("HTTP 404") for e in r["errors"])
    assert "2 of 2 requests failed" in capsys.readouterr().err


def test_unreachable_server_and_bad_metrics_are_one_line(capsys):
    assert _bench("--base-url", "http://127.0.0.1:9", "--num-prompts", "1") == 2
    assert _bench("--base-url", "http://127.0.0.1:9", "--percentile-metrics", "ttft,latency") == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "is the server up?" in err[0] and "unknown latency" in err[1]
