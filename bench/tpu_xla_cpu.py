"""The tpu platform through torch-xla on PJRT's CPU device against the reference platform on the
same CPU (issue 24): XLA compile time per decode bucket, decode step time per bucket.

    PJRT_DEVICE=CPU python bench/tpu_xla_cpu.py --out tpu_xla_cpu.json     # in the k3[tpu] venv

k3-tiny float32 (random weights). For each batch bucket B it captures the decode graph
(`k3_graph_runner`: the step traced, compiled, replayed once) and records torch-xla's
`CompileTime` (the compilations and their summed time) and the wall time of the capture; then it
times the replayed step of B sequences (context 31 tokens, the metadata padded to the bucket
and uploaded, the logits read back) against the same step eagerly on the reference platform
(pure torch on the CPU), medians over --iters. Only ratios mean anything: PJRT's CPU client is
not a TPU, and the absolute times say nothing about one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as host
import statistics
import tempfile
import time

import torch

PAGE, CONTEXT = 16, 31


def build(platform, ckpt):
    from k3.cache.pool import CachePool
    from k3.checkpoint.loader import load_checkpoint
    from k3.config import K3Config

    model = platform.build_model(K3Config.from_pretrained(ckpt), dtype=torch.float32)
    load_checkpoint(model, ckpt, progress=False)
    platform.process_weights(model)
    model.model.fold_weights()
    return model


def metadata(model, b: int, device, pages: int, first_page: int):
    from k3.model.metadata import ForwardMetadata

    ids = [[(29 * i + 3) % model.cfg.vocab_size] for i in range(b)]
    table = torch.arange(b * pages, dtype=torch.int32).view(b, pages) + first_page  # after state rows and scratch
    return ForwardMetadata.build(ids, context_lens=[CONTEXT] * b, state_indices=list(range(b)), block_table=table,
                                 page_size=PAGE, device=device)


def zeroed_pool(model, platform, rows):
    from k3.cache.pool import CachePool

    pool = CachePool.for_model(model, rows, block_size=PAGE, platform=platform)
    views = pool.views
    for t in [t for v in views.kda for t in (v.recurrent, v.conv)] + [v.pages for v in views.latent]:
        t.zero_()                                   # a defined context to attend to (the values do not matter)
    return pool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--buckets", default="1,2,4,8")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla
    import torch_xla.debug.metrics as met

    from k3.cli.checkpoint import init_checkpoint
    from k3.engine.graphs import DecodeGraphs
    from k3.platform import select_platform

    buckets = [int(b) for b in args.buckets.split(",")]
    ckpt = init_checkpoint("k3-tiny", tempfile.mkdtemp(prefix="tpu-bench-") + "/k3-tiny", progress=False)
    tpu, ref = select_platform("tpu"), select_platform("reference")
    xla_model, ref_model = build(tpu, ckpt), build(ref, ckpt)
    pages = -(-(CONTEXT + 1) // PAGE)
    rows = max(buckets) * (pages + 1) + 1
    xla_pool, ref_pool = zeroed_pool(xla_model, tpu, rows), zeroed_pool(ref_model, ref, rows)
    torch_xla.sync()

    def compile_stats():
        data = met.metric_data("CompileTime") or (0, 0.0, [])
        return int(data[0]), float(data[1]) / 1e9

    results = []
    for b in buckets:
        n0, s0 = compile_stats()
        t = time.perf_counter()
        graphs = DecodeGraphs(xla_model, xla_pool.views, tpu.graph_runner, buckets=[b], scratch_row=max(buckets),
                              block_size=PAGE, max_pages=pages, device=torch_xla.device(), progress=False)
        capture_s = time.perf_counter() - t
        n1, s1 = compile_stats()
        first = max(buckets) + 1
        meta_host = metadata(ref_model, b, "cpu", pages, first)

        def xla_step():
            meta = metadata(xla_model, b, torch_xla.device(), pages, first)
            return graphs.run(meta).cpu()

        def ref_step():
            with torch.no_grad():
                return ref_model(meta_host, ref_pool.views, tap_layers=()).logits

        xla_step(), ref_step()                                  # warm
        n2, _ = compile_stats()
        times = {}
        for name, fn in (("xla", xla_step), ("reference", ref_step)):
            samples = []
            for _ in range(args.iters):
                t = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t) * 1e3)
            times[name] = statistics.median(samples)
        steady = compile_stats()[0] - n2
        row = {"bucket": b, "capture_s": capture_s, "compiles": n1 - n0, "compile_s": s1 - s0,
               "xla_step_ms": times["xla"], "reference_step_ms": times["reference"],
               "ratio_xla_over_reference": times["xla"] / times["reference"], "steady_compiles": steady}
        results.append(row)
        print(json.dumps(row), flush=True)
    out = {"date": datetime.date.today().isoformat(), "machine": f"{host.machine()} {os.cpu_count()} cores",
           "torch": torch.__version__, "torch_xla": torch_xla.__version__, "model": "k3-tiny float32 random",
           "context": CONTEXT, "iters": args.iters, "results": results}
    print("\nbucket | compiles | compile s | capture s | xla step ms | reference step ms | xla / reference")
    for r in results:
        print(f"{r['bucket']:6d} | {r['compiles']:8d} | {r['compile_s']:9.2f} | {r['capture_s']:9.2f} | "
              f"{r['xla_step_ms']:11.2f} | {r['reference_step_ms']:17.2f} | {r['ratio_xla_over_reference']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
