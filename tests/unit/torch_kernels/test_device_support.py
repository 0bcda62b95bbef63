"""What the torch-native kernels decide at set-up (platforms/torch_kernels/device_support.py):
no compilation and no graphs on the CPU, K3_TORCH_COMPILE=0 switches compilation off, and the
grouped GEMM probe agrees with whether this torch build runs torch._grouped_mm on the CPU."""

import torch

from k3.platforms.torch_kernels import device_support as ds


def test_cpu_runs_eagerly_without_graphs():
    assert not ds.compile_supported("cpu") and not ds.graphs_supported("cpu")
    fn = lambda x: x + 1  # noqa: E731
    assert ds.maybe_compile(fn, "cpu") is fn


def test_compile_switch(monkeypatch):
    monkeypatch.setenv(ds.COMPILE_ENV, "0")
    ds.compile_supported.cache_clear()
    try:
        assert not ds.compile_supported("cuda")
    finally:
        ds.compile_supported.cache_clear()


def test_grouped_gemm_probe_matches_the_build():
    try:
        torch._grouped_mm(torch.ones(16, 16, dtype=torch.bfloat16), torch.ones(1, 16, 16, dtype=torch.bfloat16),
                          offs=torch.tensor([16], dtype=torch.int32))
        runs = True
    except (AttributeError, RuntimeError, NotImplementedError):
        runs = False
    assert ds.grouped_gemm_supported("cpu") == runs and not ds.grouped_gemm_supported("meta")
