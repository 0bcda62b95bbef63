"""Resident memory of torch's CPU matmul under many distinct shapes (issue 32's RSS growth).

The soak benchmark's server grows ~1 MiB a request in bf16 and not in float32; the engine alone
does the same, with no live tensor growing. This isolates it to one op: F.linear of [M, K] x
[N, K]^T with M drawn at random from 1..--max-m (a serving step's token count varies this way),
for bf16 and float32, with oneDNN (mkldnn) on and off, each in a fresh process; RSS after every
round of --per-round matmuls, and the time of one matmul at M = 1 / 16 / 256 per variant.

    python bench/cpu_bf16_matmul_rss.py [--rounds 6 --per-round 300 --max-m 3000 --out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path


def _child(dtype: str, mkldnn: bool, rounds: int, per_round: int, max_m: int) -> dict:
    import random

    import torch

    def rss() -> float:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20

    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = mkldnn
    dt = getattr(torch, dtype)
    w = torch.randn(256, 512, dtype=dt)
    timing = {}
    for m in (1, 16, 256):
        x = torch.randn(m, 512, dtype=dt)
        for _ in range(3):
            torch.nn.functional.linear(x, w)
        start = time.perf_counter()
        for _ in range(20):
            torch.nn.functional.linear(x, w)
        timing[m] = round((time.perf_counter() - start) / 20 * 1e6, 1)
    rng, samples = random.Random(0), [round(rss(), 1)]
    for _ in range(rounds):
        for _ in range(per_round):
            torch.nn.functional.linear(torch.randn(rng.randrange(1, max_m + 1), 512, dtype=dt), w)
        samples.append(round(rss(), 1))
    return {"dtype": dtype, "mkldnn": mkldnn, "rss_mib": samples, "growth_mib": round(samples[-1] - samples[0], 1),
            "us_per_matmul": timing}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per-round", type=int, default=300)
    ap.add_argument("--max-m", type=int, default=3000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs=2, metavar=("DTYPE", "MKLDNN"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1] == "1", args.rounds, args.per_round, args.max_m)))
        return 0
    import torch

    rows = []
    for dtype in ("bfloat16", "float32"):
        for mkldnn in (True, False):
            out = subprocess.run([sys.executable, __file__, "--child", dtype, str(int(mkldnn)), "--rounds",
                                  str(args.rounds), "--per-round", str(args.per_round), "--max-m", str(args.max_m)],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout))
            print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "cpu_bf16_matmul_rss", "torch": torch.__version__,
              "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}", "shape": "[M, 512] x [256, 512]^T",
              "matmuls": args.rounds * args.per_round, "max_m": args.max_m, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
