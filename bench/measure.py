"""What every GPU benchmark here measures the same way: the error ratio of a check, CUDA-event
medians, the device's copy bandwidth (the byte roofline) and CUDA-graph replay times.

The scripts in bench/ run as `python3 bench/NAME.py`, which puts this folder on sys.path.
"""

from __future__ import annotations

import datetime
import json

import torch


def ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in float64."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def bench_ms(fn, rep_ms: int = 300) -> float:
    """Median milliseconds of fn (CUDA events, after warm-up: triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def copy_bandwidth_GBps(rep_ms: int = 300) -> float:
    """Device-to-device copy of 1 GiB (far past L2), bytes read plus written per second."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), rep_ms)
    return 2 * (1 << 30) / ms / 1e6


def matmul_tflops(rep_ms: int = 300) -> float:
    """bf16 8192^3 matrix product rate (TFLOP/s): the compute roofline of the prefill kernels."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / bench_ms(lambda: a @ a, rep_ms) / 1e9


def graph_replay_ms(fn, rep_ms: int = 300) -> float:
    """Median milliseconds of replaying one CUDA-graph capture of fn (warmed up eagerly and on a
    side stream first, so compilation and library handles stay out of the graph)."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay, rep_ms)


def run_header(shape: str, **extra) -> dict:
    """The fields every GPU benchmark's JSON starts with: date, device, torch and triton
    versions, the measured copy bandwidth (GB/s) and the workload's shape, plus `extra`."""
    import triton

    return {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "copy_GBps": copy_bandwidth_GBps(),
            "shape": shape, **extra}


def save(result: dict, path: str, *, show: bool = False) -> None:
    """Write the results so far (a run cut short keeps them); show: print them too."""
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    if show:
        print(json.dumps(result, indent=2))
