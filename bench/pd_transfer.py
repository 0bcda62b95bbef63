"""Prefill/decode disaggregation: time and bytes of one request's row transfer (CPU, loopback).

For each prompt length L, a producer engine prefills the prompt (kv_transfer_params
do_remote_decode) and a consumer engine pulls its rows (k3.engine.kv_transfer): one transfer
per packed cache row, the ceil(L / block) attention rows and the KDA state row. Reported per
backend (the TCP stand-in; Mooncake's transfer engine over TCP with the P2P handshake when its
wheel loads) and length: the pull's wall time (reads + confirm), rows and bytes moved, bytes
per prompt token, and beside them the planner's figures (k3.cache.capacity /
k3.cache.records): attention bytes per token and the KDA state per request, whose sum over L
tokens is what a transfer of exactly the records would move; `overhead` = moved / that (the
unused tail of the last block and each row's padding to the stride). Greedy tokens of the
consumer are checked against a single engine (a mismatch exits 1).

With --tensor-parallel-size N > 1 the producer is a `k3 serve --tensor-parallel-size N`
process and the consumer a TP N `k3.LLM` in this process (gloo ranks on the CPU): each TP rank
pulls its own shard, so a row moves N times (the attention records are replicated on every
rank, the KDA state split by heads). `bytes_per_token_per_rank` is then set against the
planner's per-rank figure (attention bytes per token, and the KDA state of one rank:
`kda_state_bytes(tensor_parallel_size=N)`), and `overhead` is moved / N x that.

Run: python3 bench/pd_transfer.py --out bench/results/pd-transfer-cpu-DATE.json
     python3 bench/pd_transfer.py --tensor-parallel-size 2 --out bench/results/pd-transfer-tp2-cpu-DATE.json
Smoke (CI): python3 bench/pd_transfer.py --smoke --out /tmp/pd.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from k3.cache.records import attention_bytes_per_token, kda_state_bytes
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams


def _engine(ckpt, dtype, block, kv=None):
    return LLMEngine(EngineConfig(model=str(ckpt), dtype=dtype, load_progress=False, kv_cache_memory_gib=0.25,
                                  block_size=block, skip_tokenizer_init=True, kv_transfer_config=kv,
                                  max_num_batched_tokens=4096))


def _run(engine, rid, prompt, params):
    engine.add_request(rid, prompt, params)
    last = None
    while engine.has_unfinished_requests():
        last = next((o for o in engine.step() if o.request_id == rid), last)
    return last


def _mooncake_loads() -> str | None:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def measure(ckpt, *, dtype: str, block: int, lengths: list[int], repeats: int, connector: str) -> dict:
    kv = lambda role: {"kv_connector": connector, "kv_role": role}  # noqa: E731
    ref, producer, consumer = _engine(ckpt, dtype, block), _engine(ckpt, dtype, block, kv("kv_producer")), \
        _engine(ckpt, dtype, block, kv("kv_consumer"))
    cfg, fmt = consumer.model_config, consumer.cache.format
    per_token = attention_bytes_per_token(cfg, kv_cache_dtype=fmt.kv_cache_dtype,
                                          index_cache_dtype=fmt.index_cache_dtype)
    state = kda_state_bytes(cfg, activation_dtype=dtype)
    rows = []
    try:
        warm = list(range(1, block + 2))            # the first pull opens the connections: not timed
        handle = _run(producer, "warm", warm, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        _run(consumer, "warm", warm, SamplingParams(max_tokens=2, kv_transfer_params=handle.kv_transfer_params))
        for n in lengths:
            prompt = torch.randint(1, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            greedy = SamplingParams(max_tokens=4, temperature=0)
            expected = _run(ref, f"r{n}", prompt, greedy).outputs[0].token_ids
            times, moved = [], 0
            for i in range(repeats):
                handle = _run(producer, f"p{n}.{i}", prompt, SamplingParams(
                    max_tokens=4, temperature=0, kv_transfer_params={"do_remote_decode": True})).kv_transfer_params
                before = dict(consumer.kv_transfer_stats())
                out = _run(consumer, f"c{n}.{i}", prompt, SamplingParams(max_tokens=4, temperature=0,
                                                                         kv_transfer_params=handle))
                after = consumer.kv_transfer_stats()
                if out.outputs[0].token_ids != expected or after["kv_fallbacks_total"] != before["kv_fallbacks_total"]:
                    print(f"pd_transfer: L={n}: tokens differ or the transfer fell back", file=sys.stderr)
                    sys.exit(1)
                times.append(after["kv_pull_seconds_total"] - before["kv_pull_seconds_total"])
                moved = after["kv_bytes_pulled_total"] - before["kv_bytes_pulled_total"]
                num_rows = after["kv_rows_pulled_total"] - before["kv_rows_pulled_total"]
                while producer.has_unfinished_requests():
                    producer.step()
            records = n * per_token + state
            rows.append({"prompt_tokens": n, "rows": num_rows, "row_bytes": consumer.plan.layout.row_bytes,
                         "bytes_moved": moved, "bytes_per_token": moved / n,
                         "planner_bytes_per_token": per_token, "planner_state_bytes": state,
                         "planner_bytes": records, "overhead": moved / records,
                         "pull_ms_median": statistics.median(times) * 1e3, "pull_ms_min": min(times) * 1e3,
                         "gbytes_per_s": moved / statistics.median(times) / 1e9})
            print(f"{connector:18s} L={n:6d} rows={num_rows:4d} moved={moved / 1e6:8.3f} MB "
                  f"({moved / n:8.0f} B/token, planner {per_token} B/token + {state} B state, x{moved / records:.2f}) "
                  f"pull {statistics.median(times) * 1e3:8.2f} ms", file=sys.stderr)
    finally:
        producer.shutdown()
        consumer.shutdown()
    return {"connector": connector, "lengths": rows}


def _serve(ckpt, *, dtype: str, block: int, tp: int, kv: dict):
    """A `k3 serve --tensor-parallel-size tp` producer; (process, base URL)."""
    import re
    import subprocess
    import threading

    k3 = Path(sys.executable).with_name("k3")
    cmd = [str(k3)] if k3.exists() else [sys.executable, "-m", "k3.cli.main"]
    proc = subprocess.Popen([*cmd, "serve", "--model", str(ckpt), "--port", "0", "--host", "127.0.0.1", "--dtype", dtype,
                             "--kv-cache-memory", "0.25", "--block-size", str(block), "--max-num-batched-tokens", "4096",
                             "--tensor-parallel-size", str(tp), "--uvicorn-log-level", "warning",
                             "--served-model-name", "m", "--kv-transfer-config", json.dumps(kv)],
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        found = re.search(r"serving \S+ on (http://\S+)", line)
        if found:
            # keep draining its log, so a full pipe never blocks the server
            threading.Thread(target=lambda: all(True for _ in proc.stderr), daemon=True).start()
            return proc, found.group(1)
    proc.kill()
    raise RuntimeError("the producer did not start")


def _http_prefill(url: str, prompt: list[int]) -> dict:
    import urllib.request

    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                       "kv_transfer_params": {"do_remote_decode": True}}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())["kv_transfer_params"]


def measure_tp(ckpt, *, dtype: str, block: int, lengths: list[int], repeats: int, connector: str, tp: int) -> dict:
    """measure() with a TP `tp` producer (k3 serve) and consumer (k3.LLM, this process)."""
    import k3

    kv = lambda role: {"kv_connector": connector, "kv_role": role}  # noqa: E731
    ref = _engine(ckpt, dtype, block)                  # before this process joins the consumer's process group
    cfg = ref.model_config
    fmt = ref.cache.format
    per_token = attention_bytes_per_token(cfg, kv_cache_dtype=fmt.kv_cache_dtype, index_cache_dtype=fmt.index_cache_dtype)
    state = kda_state_bytes(cfg, tensor_parallel_size=tp, activation_dtype=dtype)
    proc, url = _serve(ckpt, dtype=dtype, block=block, tp=tp, kv=kv("kv_producer"))
    rows = []
    try:
        llm = k3.LLM(str(ckpt), dtype=dtype, load_progress=False, kv_cache_memory_gib=0.25, block_size=block,
                     max_num_batched_tokens=4096, tensor_parallel_size=tp, kv_transfer_config=kv("kv_consumer"))
        greedy = SamplingParams(max_tokens=4, temperature=0)

        def consume(prompt, handle):
            return llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0,
                                                                               kv_transfer_params=handle),
                                use_tqdm=False)[0].outputs[0].token_ids

        warm = list(range(1, block + 2))
        consume(warm, _http_prefill(url, warm))        # opens the connections: not timed
        for n in lengths:
            prompt = torch.randint(1, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            expected = _run(ref, f"r{n}", prompt, greedy).outputs[0].token_ids
            times = []
            for _ in range(repeats):
                handle = _http_prefill(url, prompt)
                before = llm.engine.snapshot()
                got = consume(prompt, handle)
                after = llm.engine.snapshot()
                if got != expected or after["kv_fallbacks_total"] != before["kv_fallbacks_total"]:
                    print(f"pd_transfer: TP {tp} L={n}: tokens differ or the transfer fell back", file=sys.stderr)
                    sys.exit(1)
                times.append(after["kv_pull_seconds_total"] - before["kv_pull_seconds_total"])
                moved = after["kv_bytes_pulled_total"] - before["kv_bytes_pulled_total"]
                num_rows = after["kv_rows_pulled_total"] - before["kv_rows_pulled_total"]
            records = n * per_token + state                # one rank's
            rows.append({"prompt_tokens": n, "rows": num_rows, "row_bytes": handle["row_bytes"], "tp": tp,
                         "bytes_moved": moved, "bytes_per_token": moved / n, "bytes_per_token_per_rank": moved / n / tp,
                         "planner_bytes_per_token": per_token, "planner_state_bytes_per_rank": state,
                         "planner_bytes": tp * records, "overhead": moved / (tp * records),
                         "pull_ms_median": statistics.median(times) * 1e3, "pull_ms_min": min(times) * 1e3,
                         "gbytes_per_s": moved / statistics.median(times) / 1e9})
            print(f"{connector:18s} TP {tp} L={n:6d} rows={num_rows:4d} x {tp} ranks moved={moved / 1e6:8.3f} MB "
                  f"({moved / n / tp:8.0f} B/token/rank, planner {per_token} B/token + {state} B state/rank, "
                  f"x{moved / (tp * records):.2f}) pull {statistics.median(times) * 1e3:8.2f} ms", file=sys.stderr)
        llm.shutdown()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"connector": connector, "tensor_parallel_size": tp, "lengths": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--connectors", nargs="+", default=["TCPConnector", "MooncakeConnector"],
                   help="MooncakeConnector is skipped (and the reason recorded) where its wheel does not load")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="TP size of both sides (> 1: a k3 serve producer and a k3.LLM consumer, gloo ranks)")
    p.add_argument("--smoke", action="store_true", help="two short lengths, one repeat, TCP only")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.smoke:
        args.lengths, args.repeats = [24, 80], 1
    from k3.cli.checkpoint import init_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_checkpoint(args.preset, Path(tmp) / args.preset, progress=False)
        mooncake_error = None if args.smoke else _mooncake_loads()
        connectors = [c for c in args.connectors if c == "TCPConnector" or (not args.smoke and mooncake_error is None)]
        tp = args.tensor_parallel_size
        run = measure if tp == 1 else lambda ckpt, **kw: measure_tp(ckpt, tp=tp, **kw)
        results = [run(ckpt, dtype=args.dtype, block=args.block_size, lengths=args.lengths,
                       repeats=args.repeats, connector=c) for c in connectors]
    out = {"bench": "pd_transfer", "date": datetime.date.today().isoformat(), "preset": args.preset,
           "dtype": args.dtype, "block_size": args.block_size, "tensor_parallel_size": args.tensor_parallel_size,
           "device": "cpu (loopback)", "results": results,
           "mooncake": "skipped (smoke)" if args.smoke else (mooncake_error or "ran"),
           "time": time.strftime("%H:%M:%S")}
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
