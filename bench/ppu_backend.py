"""The ppu platform's torch-native backend (issue 26) against the other ways to run k3 on the
same device, in one run, plus its W4A16 MoE against the bytes roofline.

    python3 bench/ppu_backend.py --out ppu_backend.json       # CUDA (the H200 stand-in): k3-slice
    python3 bench/ppu_backend.py --quick --out q.json         # CPU: k3-tiny, tiny sizes (the smoke test)

Variants, each a fresh engine on random weights (`--load-format dummy`) on the one device:
  - `ppu`: `--platform ppu`, its kernel table (k3.platforms.torch_kernels.native_tables) and its
    decode graphs (CUDA graphs of the compiled step; eager on the CPU);
  - `reference_table`: the same platform with the ppu entries taken out, so every entry is the
    reference platform's kernel table (k3.platforms.torch_kernels.tables) on the device, eager:
    what `--platform ppu` served before issue 26;
  - `nvidia`: `--platform nvidia` (its Triton kernels and CUDA graphs), where it is available;
  - `naive`: every entry the naive `k3.reference` op (`entry_oracle`), eager (the issue's 20x
    target is against this); its TTFT is measured at `--naive-ttft` tokens (token-serial KDA).
First `moe` (below), then per variant: decode TPOT (ms per step, from the step after every request's first token) at C =
1 / 16 / 64 concurrent requests and TTFT of one 8K-token prompt (after a warm-up prompt of the
same length). `moe`: `moe.experts` of one k3-slice layer (128 MXFP4 experts, top-16) at T =
1 / 16 / 64 / 1024 tokens for ppu (host and device dispatch), the reference table's torch
experts and the nvidia Triton kernel, each with its time, the bytes it must read (the distinct
experts the routing touches, MXFP4 codes and scales, plus activations) and that as a fraction of
the measured copy bandwidth (read + write of 1 GiB, the roofline every bench/ script uses).
Progress goes to stderr; the JSON is rewritten after every phase (`--out`), so a run cut short
keeps what it measured. `--budget-s` skips the phases that would start after it.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from k3 import reference as ref
from k3.checkpoint.writer import write_config
from k3.config import K3Config
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams
from k3.plugin.tables import KERNEL_TABLES, entry_oracle

STARTED = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {msg}", file=sys.stderr, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_ms(fn, reps: int) -> float:
    """Median milliseconds of fn over `reps` calls after two warm-up calls (host clock around a
    device synchronisation: works on any torch device, Triton or not)."""
    fn(), fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def copy_GBps(device: str, nbytes: int) -> float:
    """Device copy bandwidth: bytes read plus written per second of one `nbytes` copy."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed_ms(lambda: dst.copy_(src), 10) / 1e6


# ------------------------------------------------------------------------------ kernel variants

def naive_tables(device=None) -> dict:
    """family -> a table of the naive k3.reference op of every entry."""
    return {t.FAMILY: t(**{e: getattr(ref, entry_oracle(t, e)) for e in t.entries()}) for t in KERNEL_TABLES}


class Variant:
    """Patch which kernel tables a platform resolves while an engine is built (the tables are
    read once, at platform selection)."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        import k3.platform.reference as reference_plugin
        import k3.platforms.torch_kernels.native_tables as native

        self._saved = (native.native_tables, reference_plugin.torch_tables)
        if self.name in ("reference_table", "naive"):
            native.native_tables = lambda device: collections.defaultdict(lambda: None)
        if self.name == "naive":
            reference_plugin.torch_tables = naive_tables
        return self

    def __exit__(self, *exc):
        import k3.platform.reference as reference_plugin
        import k3.platforms.torch_kernels.native_tables as native

        native.native_tables, reference_plugin.torch_tables = self._saved

    @property
    def platform(self) -> str:
        return "nvidia" if self.name == "nvidia" else "ppu"

    @property
    def eager(self) -> bool:
        return self.name in ("reference_table", "naive")


# ------------------------------------------------------------------------------ engine figures

def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n,), generator=g).tolist()


def decode(engine, c: int, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i in range(c):
        engine.add_request(f"d{c}-{i}-{time.monotonic_ns()}", prompt(prompt_len, i, vocab), params)
    started, steps, t0 = set(), 0, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if t0 is not None:
            steps += 1
        started.update(o.request_id for o in outs if o.outputs[0].token_ids)
        if t0 is None and len(started) == c:
            t0 = time.perf_counter()
    sync()
    elapsed = time.perf_counter() - t0
    return {"concurrency": c, "steps": steps, "tpot_ms": 1e3 * elapsed / max(steps, 1)}


def ttft_ms(engine, ids: list[int]) -> float:
    engine.add_request(f"t{time.monotonic_ns()}", ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    sync()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    sync()
    return 1e3 * (time.perf_counter() - t0)


def engine_figures(model_dir: str, variant: Variant, args, vocab: int, out: dict, save) -> None:
    with variant:
        engine = LLMEngine(EngineConfig(
            model=model_dir, platform=variant.platform, load_format="dummy", skip_tokenizer_init=True,
            dtype=args.dtype, max_num_seqs=max(args.concurrency), max_model_len=args.ttft + 256,
            max_num_batched_tokens=args.ttft, load_progress=False, async_scheduling=False,
            kv_cache_memory_gib=args.kv_cache_gib, gpu_memory_utilization=args.gpu_memory_utilization,
            enforce_eager=variant.eager, graph_batch_sizes=tuple(args.concurrency)))
    out["providers"] = dict(collections.Counter(engine.platform.kernels.providers.values())) \
        if hasattr(engine, "platform") else None
    out["graphs"] = engine.runner.graphs.buckets if engine.runner.graphs is not None else None
    log(f"{variant.name}: engine built (graphs {out['graphs']})")
    decode(engine, 1, 16, 3, vocab)                                   # warm-up
    out["decode"] = []
    tokens = args.naive_decode_tokens if variant.name == "naive" else args.decode_tokens
    for c in args.concurrency:
        if time.perf_counter() - STARTED > args.budget_s:
            out["skipped"] = "time budget"
            break
        out["decode"].append(decode(engine, c, args.prompt_len, tokens, vocab))
        save(f"{variant.name} decode C={c}: {out['decode'][-1]['tpot_ms']:.2f} ms/token")
    n = args.naive_ttft if variant.name == "naive" else args.ttft
    if time.perf_counter() - STARTED < args.budget_s:
        if variant.name != "naive":
            ttft_ms(engine, prompt(n, 2000 + n, vocab))                # warm-up of the same length
        out["ttft_ms"] = {str(n): ttft_ms(engine, prompt(n, 1000 + n, vocab))}
        save(f"{variant.name} TTFT {n}: {out['ttft_ms'][str(n)]:.1f} ms")
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ MoE microbench

def moe_figures(cfg: K3Config, device: str, args, out: dict, save) -> None:
    from k3.platforms.torch_kernels.moe_experts import experts_forward as reference_experts
    from k3.platforms.torch_kernels.moe_w4a16 import build_experts
    from k3.quant.mxfp4 import MXFP4Tensor

    e, k = cfg.num_experts, cfg.num_experts_per_token
    hidden, inter = cfg.routed_expert_hidden_size or cfg.hidden_size, cfg.moe_intermediate_size
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device=device).manual_seed(0)

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)

    def scales(*shape):                      # 2^-8 .. 2^-5: finite weights of a sensible size
        return torch.randint(119, 122, shape, dtype=torch.uint8, device=device, generator=g)

    w13 = MXFP4Tensor(codes(e, 2 * inter, hidden // 2), scales(e, 2 * inter, hidden // 32))
    w2 = MXFP4Tensor(codes(e, hidden, inter // 2), scales(e, hidden, inter // 32))
    per_expert = (w13.packed[0].numel() + w13.scales[0].numel() + w2.packed[0].numel() + w2.scales[0].numel())
    kernels = {"ppu_host": (build_experts(device), False), "ppu_dense": (build_experts(device), True),
               "reference_table": (reference_experts, False)}
    if device.startswith("cuda"):
        try:
            from k3.platforms.triton_kernels.moe_mxfp4 import experts_forward as nvidia_experts

            kernels["nvidia"] = (nvidia_experts, False)
        except ImportError as err:
            out["nvidia_missing"] = str(err)
    out["copy_GBps"] = copy_GBps(device, args.copy_bytes)
    out["shape"] = {"experts": e, "top_k": k, "hidden": hidden, "inter": inter, "dtype": args.dtype}
    out["rows"] = []
    for t in args.moe_tokens:
        x = torch.randn(t, hidden, device=device, generator=g).to(dtype)
        ids = torch.rand(t, e, device=device, generator=g).topk(k, dim=-1).indices.int()
        tw = torch.rand(t, k, device=device, generator=g)
        touched = int(ids.unique().numel())
        nbytes = touched * per_expert + 2 * x.numel() * x.element_size()
        want = None
        for name, (fn, dense) in kernels.items():
            if time.perf_counter() - STARTED > args.budget_s:
                break
            if name == "ppu_dense" and t > 64:
                continue                               # device dispatch is the decode (graph) path
            call = lambda: fn(x, w13, w2, tw, ids, activation="situ", beta=4.0, dense_dispatch=dense)  # noqa: E731
            try:
                got = call()
                want = got if want is None else want
                ms = timed_ms(call, args.reps)
            except Exception as err:                   # report, don't hide
                out["rows"].append({"kernel": name, "tokens": t, "error": f"{type(err).__name__}: {err}"})
                continue
            row = {"kernel": name, "tokens": t, "ms": ms, "experts_touched": touched, "bytes": nbytes,
                   "GBps": nbytes / ms / 1e6, "roofline_fraction": nbytes / ms / 1e6 / out["copy_GBps"],
                   "error_ratio_vs_first": ((got.double() - want.double()).norm()
                                            / want.double().norm().clamp_min(1e-30)).item()}
            out["rows"].append(row)
            save(f"moe {name} T={t}: {ms:.3f} ms, {row['roofline_fraction']:.2f} of the byte roofline")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="ppu_backend.json")
    parser.add_argument("--quick", action="store_true", help="k3-tiny on the CPU, tiny sizes (seconds)")
    parser.add_argument("--variants", nargs="+", default=["ppu", "nvidia", "reference_table", "naive"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--naive-decode-tokens", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--ttft", type=int, default=8192)
    parser.add_argument("--naive-ttft", type=int, default=1024)
    parser.add_argument("--moe-tokens", type=int, nargs="+", default=[1, 16, 64, 1024])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--copy-bytes", type=int, default=1 << 30)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-gib", type=float, default=0.5, help="the CPU's cache per engine")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                        help="weights + cache share of the device (0.6 leaves room for the reference table's MLA "
                             "prefill, which materialises 24 GiB at 8K)")
    parser.add_argument("--compile-step", action="store_true",
                        help="K3_PPU_COMPILE_STEP=1: also compile each decode graph's whole step (minutes)")
    parser.add_argument("--no-compile", action="store_true",
                        help="K3_TORCH_COMPILE=0: the ppu entries and decode graphs without torch.compile")
    parser.add_argument("--budget-s", type=float, default=330.0, help="start no phase after this many seconds")
    args = parser.parse_args()
    import os

    if args.no_compile:
        os.environ["K3_TORCH_COMPILE"] = "0"
    if args.compile_step:
        os.environ["K3_PPU_COMPILE_STEP"] = "1"
    preset = "k3-slice"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        preset, args.dtype, args.concurrency, args.decode_tokens, args.naive_decode_tokens = \
            "k3-tiny", "float32", [1, 2], 2, 2
        args.prompt_len, args.ttft, args.naive_ttft, args.moe_tokens, args.reps, args.copy_bytes = \
            8, 16, 8, [1, 16], 2, 1 << 22
        args.kv_cache_gib = 0.05
        args.variants = [v for v in args.variants if v != "nvidia" or device == "cuda"]
    cfg = K3Config.preset(preset)
    result = {"date": datetime.date.today().isoformat(), "preset": preset, "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "args": vars(args)}

    def save(phase: str) -> None:
        Path(args.out).write_text(json.dumps(result, indent=2))
        log(phase)

    result["moe"] = {}
    try:
        moe_figures(cfg, device, args, result["moe"], save)
    except Exception as err:
        traceback.print_exc()
        result["moe"]["error"] = f"{type(err).__name__}: {err}"
    with tempfile.TemporaryDirectory() as model_dir:
        write_config(Path(model_dir), cfg)
        for name in args.variants:
            result[name] = {}
            try:
                engine_figures(model_dir, Variant(name), args, cfg.vocab_size, result[name], save)
            except Exception as err:                   # report, don't hide: the next variant still runs
                traceback.print_exc()
                result[name]["error"] = f"{type(err).__name__}: {err}"
            save(f"{name} done")
    ppu, nv, naive = (result.get(v, {}) for v in ("ppu", "nvidia", "naive"))
    summary = {}
    for mine, other, key in ((ppu, nv, "tpot_vs_nvidia"), (ppu, naive, "speedup_vs_naive")):
        pairs = {d["concurrency"]: d["tpot_ms"] for d in other.get("decode", [])}
        summary[key] = {str(d["concurrency"]): (d["tpot_ms"] / pairs[d["concurrency"]] if key == "tpot_vs_nvidia"
                                                else pairs[d["concurrency"]] / d["tpot_ms"])
                        for d in mine.get("decode", []) if d["concurrency"] in pairs}
    result["summary"] = summary
    save(f"done: {json.dumps(summary)}")


if __name__ == "__main__":
    main()
