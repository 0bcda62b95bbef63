"""`k3 bench serve`: load an OpenAI-compatible server and report its latencies and throughput.

    k3 bench serve [--base-url URL | --host H --port P] [--model NAME] [--backend openai|openai-chat]
                   [--num-prompts N] [--request-rate R] [--burstiness B] [--max-concurrency C]
                   [--dataset-name random|custom] [--random-input-len L] [--random-output-len L]
                   [--prompt TEXT ... | --dataset-path FILE] [--save-result [--result-dir D] [--result-filename F]]

The shape and flag names of `vllm bench serve` (the same flags drive either server, and the JSON
of --save-result has vLLM's field names, so both feed the same scripts): the prompts come from
`bench_prompts`, the load from `bench_client` (asyncio + httpx2), the numbers from
`bench_metrics`. The table goes to stdout; progress to stderr. Exit codes: 0 every request
succeeded, 1 some failed (the run still reports and saves), 2 bad arguments or an unreachable
server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime
from pathlib import Path

from .common import CliError


def _rate(value: str) -> float:
    rate = float(value)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {value}")
    return rate


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="{serve}", required=True)
    add = getattr(parser, "add_command", None)
    help_text = "load an OpenAI-compatible server (the shape of `vllm bench serve`)"
    serve = (add(sub, "serve", help=help_text, description=help_text) if add is not None
             else sub.add_parser("serve", help=help_text, description=help_text))
    serve.add_argument("--backend", choices=("openai", "openai-chat"), default="openai",
                       help="openai: /v1/completions (default); openai-chat: /v1/chat/completions")
    serve.add_argument("--base-url", default=None, metavar="URL",
                       help="the server's address (default http://HOST:PORT)")
    serve.add_argument("--host", default="127.0.0.1", help="with no --base-url (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="with no --base-url (default 8000)")
    serve.add_argument("--endpoint", default=None, metavar="PATH",
                       help="the API path (default /v1/completions or /v1/chat/completions by --backend)")
    serve.add_argument("--model", default=None, metavar="NAME",
                       help="the `model` of every request (default: the first of the server's /v1/models)")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="sent as `Authorization: Bearer KEY` (default $OPENAI_API_KEY, else $K3_API_KEY)")
    serve.add_argument("--dataset-name", choices=("random", "custom"), default="random",
                       help="random (default): prompts of --random-input-len tokens; custom: --prompt / "
                            "--dataset-path prompts")
    serve.add_argument("--dataset-path", default=None, metavar="FILE",
                       help="custom prompts: one per line, or JSON lines with a \"prompt\" field")
    serve.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                       help="a custom prompt (repeatable; the requests cycle through them)")
    serve.add_argument("--num-prompts", type=_positive, default=1000, help="requests to send (default 1000)")
    serve.add_argument("--random-input-len", type=_positive, default=1024, help="random prompt tokens (default 1024)")
    serve.add_argument("--random-output-len", type=_positive, default=128,
                       help="random requests' max_tokens (default 128)")
    serve.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="draw each length from [len * (1 - r), len * (1 + r)] (default 0: exact)")
    serve.add_argument("--random-vocab-size", type=_positive, default=256,
                       help="random token ids are drawn from [0, N) (default 256: the byte tokens)")
    serve.add_argument("--custom-output-len", type=_positive, default=256,
                       help="custom prompts' max_tokens (default 256)")
    serve.add_argument("--request-rate", type=_rate, default=float("inf"),
                       help="requests per second (default inf: all at once); arrivals are a Poisson process")
    serve.add_argument("--burstiness", type=_rate, default=1.0,
                       help="the gamma shape of the arrival gaps (default 1: Poisson; < 1 burstier)")
    serve.add_argument("--max-concurrency", type=_positive, default=None,
                       help="at most this many requests in flight (default: no limit)")
    serve.add_argument("--ignore-eos", action="store_true", help="generate max_tokens every time (ignore_eos)")
    serve.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    serve.add_argument("--seed", type=int, default=0, help="seeds the random prompts and arrivals (default 0)")
    serve.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                       help="comma list of ttft, tpot, itl, e2el (default all four)")
    serve.add_argument("--metric-percentiles", default="99", help="comma list of percentiles (default 99)")
    serve.add_argument("--save-result", action="store_true", help="write the result as JSON (vLLM's field names)")
    serve.add_argument("--result-dir", default=None, metavar="DIR", help="where --save-result writes (default .)")
    serve.add_argument("--result-filename", default=None, metavar="NAME",
                       help="default BACKEND-RATEqps[-concurrencyC]-MODEL-DATE.json, as vLLM names it")
    serve.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _metrics(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[float, ...]]:
    from .bench_metrics import METRICS

    metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    unknown = sorted(set(metrics) - set(METRICS))
    if unknown:
        raise CliError(f"--percentile-metrics: unknown {', '.join(unknown)} (choose from {', '.join(METRICS)})")
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p.strip())
    except ValueError:
        raise CliError(f"--metric-percentiles {args.metric_percentiles!r}: expected numbers like 50,90,99") from None
    if not percentiles or not all(0 <= p <= 100 for p in percentiles):
        raise CliError(f"--metric-percentiles {args.metric_percentiles!r}: percentiles lie in [0, 100]")
    return metrics, percentiles


def _prompts(args: argparse.Namespace):
    from .bench_prompts import given_prompts, random_prompts

    try:
        if args.dataset_name == "custom":
            return given_prompts(args.num_prompts, args.custom_output_len, prompts=args.prompt,
                                 dataset_path=args.dataset_path)
        if args.prompt or args.dataset_path:
            raise CliError("--prompt and --dataset-path need --dataset-name custom")
        return random_prompts(args.num_prompts, args.random_input_len, args.random_output_len,
                              range_ratio=args.random_range_ratio, vocab_size=args.random_vocab_size,
                              as_text=args.backend == "openai-chat", seed=args.seed)
    except (ValueError, OSError) as e:
        raise CliError(str(e)) from None


def _served_model(base_url: str, api_key: str | None) -> str:
    """The first model id of the server's /v1/models."""
    import httpx2 as httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30, trust_env=False)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise CliError(f"cannot list the models of {base_url} ({type(e).__name__}: {e}); is the server up? "
                       "(or give --model)") from None


def result_filename(args: argparse.Namespace, model: str, date: str) -> str:
    """vLLM's default --result-filename."""
    rate = args.request_rate if args.request_rate < float("inf") else "inf"
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    return f"{args.backend}-{rate}qps{concurrency}-{model.split('/')[-1]}-{date}.json"


def run(args: argparse.Namespace) -> int:
    import asyncio

    from .bench_client import run_load
    from .bench_metrics import benchmark_result, format_report

    metrics, percentiles = _metrics(args)
    prompts = _prompts(args)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("K3_API_KEY")
    model = args.model or _served_model(base_url, api_key)
    started = datetime.now().strftime("%Y%m%d-%H%M%S")
    print(f"k3 bench serve: {len(prompts)} requests to {base_url} ({args.backend}, model {model}, request rate "
          f"{args.request_rate:g}/s, max concurrency {args.max_concurrency or 'unlimited'})", file=sys.stderr)
    outputs, duration = asyncio.run(run_load(
        base_url, args.backend, model, prompts, endpoint=args.endpoint, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
        temperature=args.temperature, api_key=api_key, seed=args.seed, progress=not args.disable_tqdm))
    result = benchmark_result(outputs, duration, percentile_metrics=metrics, metric_percentiles=percentiles)
    print(format_report(result, percentile_metrics=metrics, metric_percentiles=percentiles))
    if result["failed"]:
        first = next(o.error for o in outputs if not o.success)
        print(f"k3 bench serve: {result['failed']} of {len(outputs)} requests failed; the first: {first}",
              file=sys.stderr)
    if args.save_result:
        saved = {"date": started, "backend": args.backend, "model_id": model, "tokenizer_id": model,
                 "num_prompts": args.num_prompts,
                 "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
                 "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, **result}
        path = Path(args.result_dir or ".") / (args.result_filename or result_filename(args, model, started))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(saved, indent=2) + "\n")
        print(f"k3 bench serve: result written to {path}", file=sys.stderr)
    return 1 if result["failed"] else 0
