"""Probe the kernel call contract on torch-xla (docs/kernel-contract.md, "Experiment").

Runs k3.reference ops and one tiny-model decode step on an XLA device and reports, per case:
graph compilations, device-to-host transfers (host synchronisation), ops that fell back to
the CPU, and the largest difference from the same call on the CPU. Needs a torch-xla venv:

    python3 -m venv /tmp/xla-venv && /tmp/xla-venv/bin/pip install torch==2.9.0 torch-xla==2.9.0 pluggy
    PJRT_DEVICE=CPU PYTHONPATH=<dir with a `k3` link to core/> /tmp/xla-venv/bin/python \
        docs/experiments/xla_contract_probe.py

(`pip install --no-deps -e .` into that venv works too.) `--replace-fallbacks` first swaps
the two ops that torch-xla 2.9 cannot lower on the decode path (`Tensor.unfold` in short_conv's
windows, `torch.exp2` in the MXFP4 E8M0 table) for exact equivalents, to show what remains.
Not collected by pytest; imports torch_xla only inside main().
"""

from __future__ import annotations

import inspect
import json
import sys

import torch


def _counters(met) -> dict[str, float]:
    out = {name: met.counter_value(name) or 0 for name in met.counter_names()}
    for name in ("CompileTime", "TransferFromDeviceTime"):
        data = met.metric_data(name)
        out[name] = data[0] if data else 0
    return out


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def probe(name, fn, args, kwargs, device, met, sync, results):
    """Run fn on the CPU and on the XLA device; record compiles, transfers and fallbacks."""
    try:
        expected = _first(fn(*args, **kwargs))
    except Exception as e:  # the CPU build may lack an op (torch 2.9: indexing float8 tensors)
        expected, cpu_error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    met.clear_all()
    try:
        out = _first(fn(*_to(args, device), **_to(kwargs, device)))
        sync()
        c = _counters(met)
        got = out.cpu()
        diff = cpu_error if expected is None else \
            (got.double() - expected.double()).abs().nan_to_num(float("inf")).max().item()
        row = {"case": name, "compiles": c.get("UncachedCompile", 0), "host_transfers": c["TransferFromDeviceTime"],
               "local_scalar_dense": c.get("aten::_local_scalar_dense", 0),
               "cpu_fallbacks": sorted(k for k in c if k.startswith("aten::") and k != "aten::_local_scalar_dense"),
               "max_abs_diff_vs_cpu": diff}
    except Exception as e:  # report and go on
        row = {"case": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    results.append(row)
    print(json.dumps(row), flush=True)


def mla_case(n, page_size=16, max_pages=4, heads=4, dn=16, dr=8, r=32, dv=16, seed=0, lens=None, fp8=False):
    g = torch.Generator().manual_seed(seed)
    pages = n * max_pages + 1
    cache = torch.randn(pages, page_size, r + dr, generator=g)
    scale = None
    if fp8:
        cache, scale = cache.to(torch.float8_e4m3fn), torch.tensor(1.0)
    table = torch.arange(n * max_pages, dtype=torch.int32).reshape(n, max_pages)
    seq_lens = torch.tensor(lens or [1 + (7 * i) % (page_size * max_pages) for i in range(n)])
    args = (torch.randn(n, heads, dn, generator=g), torch.randn(n, heads, dr, generator=g), cache, table, seq_lens,
            torch.randn(heads, dn, r, generator=g), torch.randn(heads, r, dv, generator=g))
    return args, {"scale": 0.1, "kv_cache_scale": scale}


def kda_case(b, t, h=2, k=16, v=16, seed=0, packed=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, t, h, k, generator=g), dim=-1)
    kk = torch.nn.functional.normalize(torch.randn(b, t, h, k, generator=g), dim=-1)
    args = (q, kk, torch.randn(b, t, h, v, generator=g), -torch.rand(b, t, h, k, generator=g),
            torch.rand(b, t, h, generator=g))
    kwargs = {"initial_state": torch.randn(b, h, k, v, generator=g)}
    if packed:   # the same tokens as one packed batch of b sequences of t tokens
        args = tuple(a.reshape(1, b * t, *a.shape[2:]) for a in args)
        kwargs["cu_seqlens"] = torch.arange(0, b * t + 1, t, dtype=torch.int32)
    return args, kwargs


def ref_cases():
    from k3 import reference as ref

    g = torch.Generator().manual_seed(1)
    yield "mla_decode N=4 (first call)", ref.mla_decode, *mla_case(4)
    yield "mla_decode N=4 other seq_lens (same shapes)", ref.mla_decode, *mla_case(4, seed=1, lens=[64, 3, 17, 40])
    yield "mla_decode N=8 (new N)", ref.mla_decode, *mla_case(8)
    yield "mla_decode N=4 seq_len 0 padding row", ref.mla_decode, *mla_case(4, lens=[5, 0, 9, 0])
    yield "mla_decode N=4 fp8 cache", ref.mla_decode, *mla_case(4, fp8=True)
    a, kw = mla_case(4)
    yield "mla_decode N=4 DSA topk_indices", ref.mla_decode, a, {**kw, "topk_indices": torch.tensor(
        [[0, -1], [1, 0], [3, 2], [0, 5]], dtype=torch.int32)}
    yield "mla_decode N=2 verify 3 tokens each (cu_seqlens_q)", ref.mla_decode, (
        torch.randn(6, 4, 16, generator=g), torch.randn(6, 4, 8, generator=g), *mla_case(2, lens=[10, 33])[0][2:]), {
        "scale": 0.1, "cu_seqlens_q": torch.tensor([0, 3, 6], dtype=torch.int32)}
    yield "kda_recurrent B=N=4 T=1 (decode, no cu_seqlens)", ref.kda_recurrent, *kda_case(4, 1)
    yield "kda_recurrent B=N=4 T=1 other values", ref.kda_recurrent, *kda_case(4, 1, seed=3)
    yield "kda_recurrent B=N=4 T=4 per-position states (verify)", ref.kda_recurrent, kda_case(4, 4)[0], {
        **kda_case(4, 4)[1], "output_per_position_states": True}
    yield "kda_recurrent packed N=4 T=1 (cu_seqlens)", ref.kda_recurrent, *kda_case(4, 1, packed=True)
    yield "kda_chunked B=2 T=64 (no cu_seqlens)", ref.kda_chunked, *kda_case(2, 64)
    yield "kda_chunked packed N=2 T=64 (cu_seqlens)", ref.kda_chunked, *kda_case(2, 64, packed=True)
    x, w, st = torch.randn(4, 1, 24, generator=g), torch.randn(24, 4, generator=g), torch.randn(4, 24, 3, generator=g)
    yield "short_conv B=N=4 T=1 with conv_state (decode)", ref.short_conv, (x, w), {"conv_state": st}
    yield "short_conv packed N=4 (cu_seqlens)", ref.short_conv, (x.reshape(1, 4, 24), w), {
        "conv_state": st, "cu_seqlens": torch.arange(5, dtype=torch.int32)}
    logits = torch.randn(6, 32, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(6)])
    yield "experts_forward T=6 E=8 k=2", ref.experts_forward, (
        torch.randn(6, 16, generator=g), torch.randn(8, 24, 16, generator=g), torch.randn(8, 16, 12, generator=g),
        torch.rand(6, 2, generator=g), ids), {"activation": "silu"}
    if "dense_dispatch" in inspect.signature(ref.experts_forward).parameters:
        yield "experts_forward T=6 E=8 k=2 dense_dispatch", ref.experts_forward, (
            torch.randn(6, 16, generator=g), torch.randn(8, 24, 16, generator=g), torch.randn(8, 16, 12, generator=g),
            torch.rand(6, 2, generator=g), ids), {"activation": "silu", "dense_dispatch": True}
    yield "select_experts", ref.select_experts, (logits,), {"top_k": 4, "scoring": "sigmoid", "renormalize": True}
    yield "rms_norm", ref.rms_norm, (torch.randn(6, 32, generator=g), torch.randn(32, generator=g), 1e-5), {}
    yield "fp8_quantize per tensor (cache write)", ref.fp8_quantize, (torch.randn(6, 40, generator=g),), {
        "scale": torch.tensor(0.05)}
    yield "sample (temperature 0 and 1 rows)", ref.sample, (logits,), {"temperature": torch.tensor(
        [0.0, 1.0, 0.0, 1.0, 0.0, 1.0])}
    yield "indexer_topk", ref.indexer_topk, (torch.randn(6, 40, generator=g),), {"topk": 8}


def _move_cache(cache, device):
    for view in cache.kda:
        view.recurrent, view.conv = view.recurrent.to(device), view.conv.to(device)
    for view in cache.latent:
        view.pages = view.pages.to(device)
        view.scale = None if view.scale is None else view.scale.to(device)
    return cache


def model_decode(device, met, sync, results):
    """k3-tiny in fp32: prefill two sequences on the CPU, then two decode steps (N=2, one new
    token each) on the CPU and on XLA from the same cache; the second XLA step must reuse the
    first step's compiled graph (only values change)."""
    import copy

    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.model.metadata import ForwardMetadata

    import tempfile

    from k3.cache.pool import CachePool
    from k3.checkpoint.loader import load_checkpoint
    from k3.checkpoint.random_init import random_checkpoint
    from k3.checkpoint.writer import write_checkpoint

    cfg = K3Config.preset("k3-tiny")
    model = K3ForCausalLM(cfg, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(tmp, cfg, random_checkpoint(cfg, seed=0))
        load_checkpoint(model, tmp, progress=False)
    table = torch.arange(2, 6, dtype=torch.int32).reshape(2, 2)             # pages after the 2 state rows
    cache = CachePool.for_model(model, 6, block_size=16).views
    model(ForwardMetadata.build([[1, 2, 3], [4, 5]], context_lens=[0, 0], state_indices=[0, 1],
                                block_table=table, page_size=16), cache)
    xla_model, xla_cache = copy.deepcopy(model).to(device), _move_cache(copy.deepcopy(cache), device)
    for step, (tokens, ctx) in enumerate([([[6], [7]], [3, 2]), ([[8], [9]], [4, 3])]):
        name = f"k3-tiny decode step {step + 1} N=2 (model forward)"

        def meta(dev):
            return ForwardMetadata.build(tokens, context_lens=ctx, state_indices=[0, 1], block_table=table,
                                         page_size=16, device=dev)

        expected = model(meta("cpu"), cache).logits
        try:
            m = meta(device)
            sync()
            met.clear_all()
            got = xla_model(m, xla_cache).logits
            sync()
            c = _counters(met)
            row = {"case": name, "compiles": c.get("UncachedCompile", 0), "host_transfers": c["TransferFromDeviceTime"],
                   "local_scalar_dense": c.get("aten::_local_scalar_dense", 0),
                   "cpu_fallbacks": sorted(k for k in c if k.startswith("aten::") and k != "aten::_local_scalar_dense"),
                   "max_abs_diff_vs_cpu": (got.cpu() - expected).abs().max().item()}
        except Exception as e:
            row = {"case": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        results.append(row)
        print(json.dumps(row), flush=True)


def replace_fallbacks() -> None:
    """Monkeypatch the reference's two decode-path ops that have no XLA lowering in 2.9."""
    import k3.quant.mxfp4 as mxfp4
    import k3.reference.conv as conv

    def windows(xp, w, activation):            # xp [n, W-1+L, C], w [C, W] -> [n, L, C]
        width = w.shape[1]
        length = xp.shape[1] - width + 1
        if length < 1:
            return xp[:, :0]
        y = sum(xp[:, j:j + length] * w[:, j] for j in range(width))
        return torch.nn.functional.silu(y) if activation == "silu" else y

    def e8m0_table(dtype, device):
        exps = torch.arange(256, dtype=torch.float64, device=device) - mxfp4.E8M0_BIAS
        table = torch.pow(2.0, exps)
        return torch.where(exps == 255 - mxfp4.E8M0_BIAS, float("nan"), table).to(dtype)

    conv._conv_windows = windows
    mxfp4._e8m0_table = e8m0_table


def main() -> int:
    if "--replace-fallbacks" in sys.argv:
        replace_fallbacks()
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr

    device = torch_xla.device()
    print(json.dumps({"torch": torch.__version__, "torch_xla": torch_xla.__version__, "device": str(device),
                      "device_type": xr.device_type()}), flush=True)
    results: list[dict] = []
    for name, fn, args, kwargs in ref_cases():
        probe(name, fn, args, kwargs, device, met, torch_xla.sync, results)
    model_decode(device, met, torch_xla.sync, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
