"""MLA on the nvidia platform against the torch reference at K3's MLA shapes (96 heads,
latent 512 + RoPE 64, nope 128, value 128, page 64), in one call on the GPU.

    python3 bench/mla.py --out mla.json

Decode (k3's Triton kernel, bf16 and fp8 pages), per (batch N, context): a check against
`k3.reference.mla_decode` on the same fresh inputs (shuffled pages, error ratio), then median
times (CUDA events) of the kernel and the reference, eager and replayed from a CUDA graph (the
default: fp32 operands, the splits merged in one Triton launch; checked too, operands="native":
bf16 tensor-core products, and merge="torch": the splits merged by torch operations), and
the floor: every visible latent row read once over the measured copy bandwidth (the absorbed
weights are common to all sequences and stay in L2).
Prefill (torch's fused attention, `torch_kernels/mla_prefill_sdpa.py`): one 4,096-token prompt
and a 1,024-token chunk after a 3,072-token prefix, against `k3.reference.mla_prefill`, with the
matmul floor (expansion plus attention FLOPs over the measured bf16 matmul rate).
"""

from __future__ import annotations

import argparse

import torch

from k3 import reference as ref
from k3.platforms.torch_kernels import mla_decode as torch_mla  # the reference platform's kernel
from measure import bench_ms, graph_replay_ms, matmul_tflops as measure_matmul_tflops, ratio, run_header, save

H, DN, R, DR, DV, PAGE = 96, 128, 512, 64, 128, 64


def inputs(n, context, cache_dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_each = -(-context // PAGE)
    pages = n * pages_each
    cache = torch.randn(pages, PAGE, R + DR, device="cuda", generator=g)
    scale = None
    if cache_dtype == torch.float8_e4m3fn:
        scale = torch.tensor(0.05, device="cuda")
        cache = (cache / scale).to(cache_dtype)
    else:
        cache = cache.to(cache_dtype)
    table = torch.randperm(pages, device="cuda", generator=g).view(n, pages_each).int()
    lens = torch.full((n,), context, device="cuda")
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()  # noqa: E731
    args = (rnd(n, H, DN), rnd(n, H, DR), cache, table, lens, rnd(H, DN, R) / DN ** 0.5, rnd(H, R, DV) / R ** 0.5)
    return args, {"scale": (DN + DR) ** -0.5, "kv_cache_scale": scale}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="mla.json")
    args = parser.parse_args()
    from k3.platforms.triton_kernels.mla_decode import mla_decode as kernel

    result = run_header(f"H{H} latent {R}+{DR} page {PAGE}")
    copy_GBps = result["copy_GBps"]
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for n, context in ((1, 8192), (16, 8192), (64, 8192), (1, 131072)):
            key = f"{str(cache_dtype).split('.')[-1]}_N{n}_ctx{context}"
            a, kw = inputs(n, context, cache_dtype, seed=n + context)
            entry = {"error_ratio": ratio(kernel(*a, **kw), torch_mla.mla_decode(*a, **kw))}
            entry["passed"] = entry["error_ratio"] < 2e-2
            if entry["passed"]:
                entry["k3_us"] = bench_ms(lambda: kernel(*a, **kw)) * 1e3
                entry["k3_graph_us"] = graph_replay_ms(lambda: kernel(*a, **kw)) * 1e3
                # the bf16-operand variant (launch option operands="native"), checked first
                entry["native_error_ratio"] = ratio(kernel(*a, **kw, operands="native"), torch_mla.mla_decode(*a, **kw))
                if entry["native_error_ratio"] < 2e-2:
                    entry["k3_native_graph_us"] = graph_replay_ms(lambda: kernel(*a, **kw, operands="native")) * 1e3
                # the splits merged by torch operations (merge="torch", served before the Triton merge)
                entry["torch_merge_error_ratio"] = ratio(kernel(*a, **kw, merge="torch"), torch_mla.mla_decode(*a, **kw))
                if entry["torch_merge_error_ratio"] < 2e-2:
                    entry["k3_torch_merge_graph_us"] = graph_replay_ms(lambda: kernel(*a, **kw, merge="torch")) * 1e3
                if n * context <= 16 * 8192:              # the reference materialises every row in fp32
                    entry["reference_us"] = bench_ms(lambda: torch_mla.mla_decode(*a, **kw)) * 1e3
                    entry["speedup_vs_reference"] = entry["reference_us"] / entry["k3_graph_us"]
                nbytes = n * context * (R + DR) * a[2].element_size()
                entry["floor_us"] = nbytes / copy_GBps / 1e3
                entry["fraction_of_copy_bw"] = entry["floor_us"] / entry["k3_graph_us"]
            result[key] = entry
            torch.cuda.empty_cache()
            save(result, args.out)
    result["prefill"] = prefill()
    save(result, args.out, show=True)


def prefill() -> dict:
    from k3.platforms.torch_kernels.mla_prefill_sdpa import mla_prefill

    matmul_tflops = measure_matmul_tflops()
    out = {"bf16_matmul_TFLOPs": matmul_tflops}
    g = torch.Generator(device="cuda").manual_seed(5)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()  # noqa: E731
    for name, q_len, kv_len in (("T4096", 4096, 4096), ("chunk1024_after3072", 1024, 4096)):
        q, latent, k_pe = rnd(q_len, H, DN + DR), rnd(kv_len, R), rnd(kv_len, DR)
        kv_b = rnd(H * (DN + DV), R) / R ** 0.5
        kw = dict(cu_seqlens_q=torch.tensor([0, q_len], device="cuda", dtype=torch.int32),
                  cu_seqlens_kv=torch.tensor([0, kv_len], device="cuda", dtype=torch.int32),
                  scale=(DN + DR) ** -0.5, qk_nope_head_dim=DN, v_head_dim=DV)
        entry = {"error_ratio": ratio(mla_prefill(q, latent, k_pe, kv_b, **kw), ref.mla_prefill(q, latent, k_pe, kv_b, **kw))}
        entry["passed"] = entry["error_ratio"] < 2e-2
        if entry["passed"]:
            entry["k3_ms"] = bench_ms(lambda: mla_prefill(q, latent, k_pe, kv_b, **kw))
            entry["reference_ms"] = bench_ms(lambda: ref.mla_prefill(q, latent, k_pe, kv_b, **kw))
            visible = 1 - q_len / (2 * kv_len)                   # lower-right causal: share of the q x kv scores
            flops = 2 * kv_len * R * H * (DN + DV) + 2 * H * q_len * kv_len * (DN + DR + DV) * visible
            entry["floor_ms"] = flops / matmul_tflops / 1e9
            entry["fraction_of_matmul_rate"] = entry["floor_ms"] / entry["k3_ms"]
            entry["speedup_vs_reference"] = entry["reference_ms"] / entry["k3_ms"]
        out[name] = entry
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    main()
