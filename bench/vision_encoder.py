"""MoonViT encoder time per image (k3.vision reference ops), tiny tower and the full-width K3 tower.

Random weights (speed only). For each tower and image size: the median wall time of
`MoonViTTower.encode` over --iters runs after a warm-up, the achieved matmul rate against the FLOP count
of the tower's shapes, and the peer measured in the same run: one dense [n, D] x [D, 4D] matmul's rate on
the same device and dtype (the ceiling the tower's linear layers run at).

  python bench/vision_encoder.py --out bench/results/vision_encoder-cpu.json          # CPU
  python bench/vision_encoder.py --device cuda --dtype bfloat16 --out ...-h200.json   # H200
  python bench/vision_encoder.py --smoke --out /tmp/v.json                            # CI smoke
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from k3.presets import K3_VISION_CONFIG as _K3_TOWER
from k3.presets import TINY_VISION_CONFIG
from k3.vision import MoonViTConfig, MoonViTTower, init_vision_params
from k3.vision.preprocess import image_to_patches

# the published K3 vision tower feeding K3's 7168-wide text model
K3_VISION_CONFIG = {**_K3_TOWER, "text_hidden_size": 7168}


def tower_flops(c: MoonViTConfig, n: int) -> float:
    per_layer = 2 * n * (c.hidden_size * 3 * c.qkv_hidden_size + c.qkv_hidden_size * c.hidden_size
                         + 2 * c.hidden_size * c.intermediate_size) + 4 * n * n * c.qkv_hidden_size
    merged = c.hidden_size * c.merge_kernel[0] * c.merge_kernel[1]
    proj = 2 * (n // 4) * (merged * merged + merged * c.text_hidden_size)
    return c.num_layers * per_layer + proj + 2 * n * 3 * c.patch_size ** 2 * c.hidden_size


def _timed(fn, iters: int, device: str) -> float:
    fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(name: str, vc: dict, side: int, *, device: str, dtype: torch.dtype, iters: int) -> dict:
    cfg = MoonViTConfig.from_dict(vc)
    params = {k: v.to(device) for k, v in init_vision_params(cfg, dtype=dtype).items()}
    tower = MoonViTTower(cfg, params)
    img = torch.rand(3, side, side, generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    patches, (h, w) = image_to_patches(img, patch_size=cfg.patch_size, merge_kernel=cfg.merge_kernel[0],
                                       in_patch_limit=16384, patch_limit_on_one_side=512)
    preprocess_s = time.perf_counter() - t0
    patches = patches.to(device=device, dtype=dtype)
    with torch.inference_mode():
        enc_s = _timed(lambda: tower.encode(patches, [(h, w)]), iters, device)
        n = h * w
        a = torch.randn(n, cfg.hidden_size, device=device, dtype=dtype)
        b = torch.randn(cfg.hidden_size, cfg.intermediate_size, device=device, dtype=dtype)
        mm_s = _timed(lambda: a @ b, iters, device)
    flops = tower_flops(cfg, n)
    rate, peer = flops / enc_s / 1e9, 2 * n * cfg.hidden_size * cfg.intermediate_size / mm_s / 1e9
    return {"tower": name, "image_px": side, "patches": n, "image_tokens": tower.tokens_for_grid(h, w),
            "encoder_ms_per_image": enc_s * 1e3, "preprocess_ms": preprocess_s * 1e3, "gflop": flops / 1e9,
            "achieved_gflops": rate, "peer_matmul_gflops": peer, "ratio": rate / peer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--sides", default="448,896", help="square image sizes in pixels")
    ap.add_argument("--smoke", action="store_true", help="tiny tower only, one small image, 1 iteration")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    towers = [("k3-tiny-vision", {**TINY_VISION_CONFIG, "text_hidden_size": 64})]
    sides = [112] if args.smoke else [int(s) for s in args.sides.split(",")]
    if not args.smoke:
        towers.append(("k3-full-width", K3_VISION_CONFIG))
    rows = [measure(n, vc, s, device=args.device, dtype=dtype, iters=1 if args.smoke else args.iters)
            for n, vc in towers for s in sides]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"device": device, "dtype": args.dtype, "torch": torch.__version__, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(f"{r['tower']:>15} {r['image_px']}px {r['patches']} patches -> {r['image_tokens']} tokens: "
              f"{r['encoder_ms_per_image']:.1f} ms, {r['achieved_gflops']:.1f} GFLOP/s "
              f"(matmul peer {r['peer_matmul_gflops']:.1f}, {r['ratio']:.2f}x)")


if __name__ == "__main__":
    main()
