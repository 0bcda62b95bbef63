"""The benchmarks' correctness gates (bench/kda_decode.py, bench/moe_mxfp4.py) run here at tiny
shapes (Triton interpreter), so an H200 benchmark cannot silently time a kernel its own check
would reject."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("k3.platforms.triton_kernels.kda_decode")
BENCH = Path(__file__).resolve().parents[2] / "bench" / "kda_decode.py"
# the scripts import bench/measure.py as `python3 bench/NAME.py` would find it
if str(BENCH.parent) not in sys.path:
    sys.path.insert(0, str(BENCH.parent))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_kda_decode", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("layout", ["hkv", "hvk"])
def test_bench_check_passes_the_kernel(layout):
    from k3.platforms.triton_kernels.kda_decode import kda_decode_step

    result = _bench().check(kda_decode_step, 3, 2, 16, layout, "cpu", seed=0)
    assert result["passed"] and result["foreign_rows_untouched"], result


def test_bench_check_rejects_a_wrong_kernel():
    from k3.platforms.triton_kernels.kda_decode import kda_decode_step

    def off_by_a_little(*args, **kwargs):
        return kda_decode_step(*args, **kwargs) * 1.05

    assert not _bench().check(off_by_a_little, 3, 2, 16, "hkv", "cpu", seed=0)["passed"]


def test_moe_bench_check_passes_the_kernel_and_rejects_a_wrong_one():
    """bench/moe_mxfp4.py's correctness gate, at tiny shapes."""
    from k3.platforms.triton_kernels.moe_mxfp4 import experts_forward

    spec = importlib.util.spec_from_file_location("bench_moe", BENCH.with_name("moe_mxfp4.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    w13, w2 = bench.make_experts(8, 64, 96, "cpu", seed=0)
    assert bench.check(experts_forward, w13, w2, 5, 3, "cpu", seed=1)["passed"]
    assert not bench.check(lambda *a, **k: experts_forward(*a, **k) * 1.05, w13, w2, 5, 3, "cpu", seed=1)["passed"]


def test_kda_verify_bench_check_passes_the_kernel_and_rejects_a_wrong_one():
    """bench/kda_verify.py's correctness gate, at tiny shapes."""
    from k3.platforms.triton_kernels.kda_recurrent import kda_recurrent

    spec = importlib.util.spec_from_file_location("bench_kda_verify", BENCH.with_name("kda_verify.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.check(kda_recurrent, 3, 4, 2, 16, "cpu", seed=0)["passed"]

    def stale_states(*args, **kwargs):                 # right o, but the states of the token before
        out = kda_recurrent(*args, **kwargs)
        return dataclasses.replace(out, states=torch.roll(out.states, 1, dims=1))

    assert not bench.check(stale_states, 3, 4, 2, 16, "cpu", seed=0)["passed"]


def test_indexer_decode_bench_check_passes_the_kernel_and_rejects_a_wrong_one():
    """bench/indexer_decode.py's correctness gate, at tiny shapes."""
    from k3.platforms.triton_kernels.indexer_decode import paged_decode_scores

    spec = importlib.util.spec_from_file_location("bench_indexer", BENCH.with_name("indexer_decode.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.check(paged_decode_scores, 2, 40, 16, 32, 8, "cpu", seed=0)["passed"]

    def one_page_short(q, w, values, scales, table, lens, **kw):     # forgets each sequence's last position
        return paged_decode_scores(q, w, values, scales, table, lens - 1, **kw)

    assert not bench.check(one_page_short, 2, 40, 16, 32, 8, "cpu", seed=0)["passed"]
