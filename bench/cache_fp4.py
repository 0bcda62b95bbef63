"""FP4 cache records (issue 25 item 5): bytes per token the pool's views span against the
planner's, per latent / index-key format, at the real model dims (pools on the meta device, no
memory); and the CPU cost of the nvfp4 latent path at one layer of a decode step (store the
new rows, dequantise the batch's pages for the kernel: `k3.model.latent_store`), against
bf16 latents' store and pass-through.

    python bench/cache_fp4.py [--seqs 4] [--context 4096] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from k3.cache.format import CacheFormat
from k3.cache.pool import CachePool
from k3.cache.records import attention_bytes_per_token
from k3.config import K3Config
from k3.model import reference_kernels
from k3.model.latent_store import readable_latents, store_latents
from k3.model.metadata import LatentCacheView
from k3.quant.nvfp4_latent import nvfp4_latent_record_bytes

FORMATS = (("bf16", "fp8"), ("fp8", "fp8"), ("fp8", "mxfp4"), ("nvfp4", "mxfp4"))


def bytes_rows() -> list[dict]:
    rows = []
    for preset in ("kimi-k3", "kimi-k3.1-pro"):
        cfg = K3Config.preset(preset)
        for kv, idx in FORMATS:
            if idx == "mxfp4" and not cfg.uses_dsa:
                continue
            fmt = CacheFormat.build(cfg, activation_dtype=torch.bfloat16, kv_cache_dtype=kv, index_cache_dtype=idx,
                                    block_size=64)
            views = CachePool(cfg, fmt, 1, device="meta").views
            pool = sum(v.pages[0].numel() * v.pages.element_size() for v in views.latent)
            pool += sum(v.values[0].numel() * v.values.element_size() + v.scales[0].numel() * v.scales.element_size()
                        for v in views.index_keys or [])
            rows.append({"preset": preset, "kv_cache_dtype": kv, "index_cache_dtype": idx,
                         "pool_bytes_per_token": pool // fmt.block_size,
                         "planner_bytes_per_token": attention_bytes_per_token(cfg, kv_cache_dtype=kv,
                                                                              index_cache_dtype=idx)})
    return rows


def step_cost(kv: str, seqs: int, context: int, repeats: int) -> float:
    """Median ms of one MLA layer's store (one new row a sequence) + kernel-readable pages."""
    cfg = K3Config.preset("kimi-k3.1-pro")
    page, r = 64, cfg.kv_lora_rank
    pages = seqs * (context // page)
    if kv == "nvfp4":                   # one layer's pages as the pool lays them out (CachePool._latent_view)
        view = LatentCacheView(torch.full((pages, page, nvfp4_latent_record_bytes(r, cfg.qk_rope_head_dim)), 255,
                                          dtype=torch.uint8), torch.ones(()), fmt="nvfp4", kv_lora_rank=r)
    else:
        view = LatentCacheView(torch.full((pages, page, cfg.mla_latent_size), float("nan"), dtype=torch.bfloat16))
    kernels = reference_kernels()
    g = torch.Generator().manual_seed(0)
    store_latents(kernels, view, (torch.arange(pages), torch.zeros(pages, dtype=torch.long)),
                  torch.randn(pages, cfg.mla_latent_size, generator=g).bfloat16())
    table = torch.arange(pages, dtype=torch.int32).view(seqs, -1)
    rows = torch.randn(seqs, cfg.mla_latent_size, generator=g).bfloat16()
    at = (table[:, -1].long(), torch.full((seqs,), page - 1))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        store_latents(kernels, view, at, rows)
        readable_latents(kernels, view, table, torch.bfloat16)
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = {"bytes": bytes_rows(), "step_ms": {kv: step_cost(kv, args.seqs, args.context, args.repeats)
                                                 for kv in ("bf16", "nvfp4")},
              "seqs": args.seqs, "context": args.context, "torch_threads": torch.get_num_threads()}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for r in result["bytes"]:
        print(f"{r['preset']:15s} latents {r['kv_cache_dtype']:5s} keys {r['index_cache_dtype']:5s}: pool "
              f"{r['pool_bytes_per_token']:6,d} B/token, planner {r['planner_bytes_per_token']:6,d}")
    print(f"one MLA layer, {args.seqs} x {args.context} tokens: store + readable pages "
          + ", ".join(f"{kv} {ms:.2f} ms" for kv, ms in result["step_ms"].items()))


if __name__ == "__main__":
    main()
