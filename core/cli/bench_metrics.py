"""The numbers of `k3 bench serve`, named as `vllm bench serve` names them.

`benchmark_result(outputs, duration, ...)` is vLLM's result dictionary: counts (`completed`,
`failed`, `total_input_tokens`, `total_output_tokens`), throughputs (`request_throughput`,
`output_throughput`, `total_token_throughput`, per second of `duration`), the per-request lists
(`input_lens`, `output_lens`, `ttfts`, `itls`, `generated_texts`, `errors`) and, for each metric
of `percentile_metrics` (ttft, tpot, itl, e2el), `mean_<m>_ms`, `median_<m>_ms`, `std_<m>_ms`
and `p<P>_<m>_ms` for each P of `metric_percentiles`. As in vLLM: only successful requests count;
TPOT of a request is (E2E - TTFT) / (output tokens - 1), for requests of more than one token;
ITL pools every request's inter-chunk gaps; a request's output tokens are the server's
`usage.completion_tokens` (the number of chunks when the server sent no usage).
`format_report` is the text table `vllm bench serve` prints.
"""

from __future__ import annotations

import numpy as np

from .bench_client import RequestOutput

METRICS = ("ttft", "tpot", "itl", "e2el")
_TITLES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}


def percentile_key(p: float) -> str:
    """vLLM's spelling of a percentile in a key: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p) if float(p).is_integer() else p}"


def output_len(out: RequestOutput) -> int:
    """The request's output tokens: the server's count, else one per chunk."""
    return out.output_tokens if out.output_tokens is not None else (1 + len(out.itl) if out.success else 0)


def _samples(outputs: list[RequestOutput]) -> dict[str, list[float]]:
    ok = [o for o in outputs if o.success]
    tpot = [(o.latency - o.ttft) / (output_len(o) - 1) for o in ok if output_len(o) > 1]
    return {"ttft": [o.ttft for o in ok], "tpot": tpot, "itl": [t for o in ok for t in o.itl],
            "e2el": [o.latency for o in ok]}


def benchmark_result(outputs: list[RequestOutput], duration: float, *,
                     percentile_metrics: tuple[str, ...] = METRICS,
                     metric_percentiles: tuple[float, ...] = (99.0,)) -> dict:
    """vLLM's result dictionary of one run (see the module)."""
    unknown = set(percentile_metrics) - set(METRICS)
    if unknown:
        raise ValueError(f"unknown --percentile-metrics {sorted(unknown)} (choose from {', '.join(METRICS)})")
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(output_len(o) for o in ok)
    result = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "request_goodput": None,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [output_len(o) for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    samples = _samples(outputs)
    for metric in percentile_metrics:
        values = np.asarray(samples[metric] or [0.0], dtype=np.float64) * 1000.0
        result[f"mean_{metric}_ms"] = float(values.mean())
        result[f"median_{metric}_ms"] = float(np.median(values))
        result[f"std_{metric}_ms"] = float(values.std())
        for p in metric_percentiles:
            result[f"{percentile_key(p)}_{metric}_ms"] = float(np.percentile(values, p))
    return result


def format_report(result: dict, *, percentile_metrics: tuple[str, ...] = METRICS,
                  metric_percentiles: tuple[float, ...] = (99.0,)) -> str:
    """The result as the text table `vllm bench serve` prints."""
    rows = [("Successful requests:", result["completed"]), ("Failed requests:", result["failed"]),
            ("Benchmark duration (s):", f"{result['duration']:.2f}"),
            ("Total input tokens:", result["total_input_tokens"]),
            ("Total generated tokens:", result["total_output_tokens"]),
            ("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
            ("Total Token throughput (tok/s):", f"{result['total_token_throughput']:.2f}")]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines += [f"{label:<40}{value:<10}" for label, value in rows]
    for metric in percentile_metrics:
        title, short = _TITLES[metric]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append(f"{'Mean ' + short + ' (ms):':<40}{result[f'mean_{metric}_ms']:<10.2f}")
        lines.append(f"{'Median ' + short + ' (ms):':<40}{result[f'median_{metric}_ms']:<10.2f}")
        for p in metric_percentiles:
            key = percentile_key(p)
            lines.append(f"{key.upper() + ' ' + short + ' (ms):':<40}{result[f'{key}_{metric}_ms']:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)
