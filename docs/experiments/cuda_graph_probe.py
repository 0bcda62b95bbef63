"""The torch-native path on a CUDA device (docs/kernel-contract.md, "torch-native backend").

Selects the forced `ppu` platform (the reference ops on device "cuda", no Triton), builds
k3-tiny in fp32 from a random checkpoint, prefills two sequences eagerly, then captures one
decode step as a CUDA graph over static ForwardMetadata tensors and replays it for two steps,
comparing each replay with an eager step on a copy of the same cache. Prints JSON lines.

    python docs/experiments/cuda_graph_probe.py      # on a CUDA machine, k3 installed
"""

from __future__ import annotations

import copy
import functools
import json
import sys
import tempfile
import traceback

import torch


def capture_and_replay(model, cache, meta, steps) -> bool:
    """Capture one decode step over static metadata, replay it for every step; JSON lines."""
    static = meta(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                       # warm-up on copies (allocator, lazy init)
        for _ in range(2):
            model(static, copy.deepcopy(cache))
    torch.cuda.current_stream().wait_stream(side)
    graph_cache, eager_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            logits = model(static, graph_cache).logits
    except Exception as e:
        frames = [f"{f.filename.split('/core/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)
                  if "/core/" in f.filename][-4:]
        print(json.dumps({"capture": "error", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}",
                          "k3_frames": frames}), flush=True)
        return False
    print(json.dumps({"capture": "ok"}), flush=True)
    for i in range(len(steps)):
        new = meta(i)
        for name in ("input_ids", "positions", "cu_seqlens", "context_lens", "slot_mapping", "block_table",
                     "state_indices", "logits_indices"):
            getattr(static, name).copy_(getattr(new, name))
        graph.replay()
        expected = model(new, eager_cache).logits
        torch.cuda.synchronize()
        print(json.dumps({"step": i + 1, "max_abs_diff_replay_vs_eager": (logits - expected).abs().max().item(),
                          "finite": bool(torch.isfinite(logits).all())}), flush=True)
    return True


def main() -> int:
    from k3.cache.pool import CachePool
    from k3.checkpoint.loader import load_checkpoint
    from k3.checkpoint.random_init import random_checkpoint
    from k3.checkpoint.writer import write_checkpoint
    from k3.config import K3Config
    from k3.platform import select_platform
    from k3.model.metadata import ForwardMetadata

    platform = select_platform("ppu")
    print(json.dumps({"platform": platform.name, "device": platform.info.device, "forced": platform.info.forced,
                      "providers": sorted(set(platform.kernels.providers.values())),
                      "gpu": torch.cuda.get_device_name(0)}), flush=True)
    if platform.info.device != "cuda":
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    dev = "cuda"
    cfg = K3Config.preset("k3-tiny")
    model = platform.build_model(cfg, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(tmp, cfg, random_checkpoint(cfg, seed=0))
        load_checkpoint(model, tmp, progress=False)
    table = torch.arange(2, 6, dtype=torch.int32, device=dev).reshape(2, 2)             # pages after the 2 state rows
    cache = CachePool.for_model(model, 6, block_size=16, device=dev).views
    model(ForwardMetadata.build([[1, 2, 3], [4, 5]], context_lens=[0, 0], state_indices=[0, 1],
                                block_table=table, page_size=16, device=dev), cache)
    steps = [([[6], [7]], [3, 2]), ([[8], [9]], [4, 3])]

    def meta(i):
        tokens, ctx = steps[i]
        return ForwardMetadata.build(tokens, context_lens=ctx, state_indices=[0, 1], block_table=table,
                                     page_size=16, device=dev)

    if capture_and_replay(model, cache, meta, steps):
        return 0
    # MXFP4 expert dequantisation builds two lookup tables per call with host-to-device copies
    # (the E2M1 table from a Python list, the E8M0 table's NaN entry set from a host scalar),
    # which capture forbids; tables cached per (dtype, device), filled during warm-up, avoid it.
    import k3.quant.fp4 as fp4
    import k3.quant.mxfp4 as mxfp4

    fp4.e2m1_table = functools.lru_cache(maxsize=None)(fp4.e2m1_table)
    mxfp4._e8m0_table = functools.lru_cache(maxsize=None)(mxfp4._e8m0_table)
    print(json.dumps({"retry": "E2M1 and E8M0 tables cached per (dtype, device)"}), flush=True)
    capture_and_replay(model, cache, meta, steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
