"""The MXFP4 routed-experts kernel (platforms/triton_kernels/moe_mxfp4.py) against
k3.reference.experts_forward on the same MXFP4 weights: SiTU-GLU with and without the linear
beta, SiLU-GLU, bf16 and fp32 activations, ragged expert loads (an expert with no token, one
with every token), expert parallelism (ids of other ranks contribute nothing) and odd sizes; the
prefill "dequant" mode's groups of experts (byte cap, torch._grouped_mm or its loop fallback)."""

import functools
import re

import pytest
import torch

from k3 import reference as ref
from k3.quant.mxfp4 import MXFP4Tensor

kernel = pytest.importorskip("k3.platforms.triton_kernels.moe_mxfp4")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from kernel_tables import run_with, samples  # noqa: E402

from k3.platforms.triton_kernels.moe_mxfp4_common import hfma2  # noqa: E402


@triton.jit
def _hfma2_kernel(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, hfma2(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(c_ptr + i), False))

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _experts(e, inter, l, g):
    w13 = MXFP4Tensor.from_float(torch.randn(e, 2 * inter, l, generator=g) / l ** 0.5)
    w2 = MXFP4Tensor.from_float(torch.randn(e, l, inter, generator=g) / inter ** 0.5)
    return w13, w2


def _routing(t, k, e_total, g):
    ids = torch.stack([torch.randperm(e_total, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    return weights, ids


def _check(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.double() - want.double()).norm() / want.double().norm()
    assert err < TOL[dtype], err


ACTIVATIONS = {"situ": ("situ", 4.0, None), "situ_linear_beta": ("situ", 4.0, 8.0), "silu": ("silu", None, None)}
# Every activation in every mode and dtype, except the gemv mode's bf16 (fp16-pair) form under
# the interpreter (23-35 s a case): it runs with the linear beta only, since the epilogue it
# shares with the fp32 gemv form is checked there for all three activations.
MATCH_CASES = [(mode, dtype, act) for mode in ("decode", "gemv") for dtype in ("fp32", "bf16") for act in ACTIVATIONS
               if not (mode == "gemv" and dtype == "bf16" and act != "situ_linear_beta")]


@pytest.mark.parametrize("mode,dtype,act", MATCH_CASES, ids=["-".join(c[::-1]) for c in MATCH_CASES])
def test_matches_the_reference(dtype, act, mode):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    act = ACTIVATIONS[act]
    activation, beta, linear_beta = act
    g = torch.Generator().manual_seed(0)
    t, k, e, inter, l = 5, 3, 6, 64, 96
    w13, w2 = _experts(e, inter, l, g)
    weights, ids = _routing(t, k, e, g)
    ids[:, 0] = 2                                     # expert 2 gets every token; some get none
    x = torch.randn(t, l, generator=g).to(dtype)
    kw = {"activation": activation, "beta": beta, "linear_beta": linear_beta}
    got = kernel.experts_forward(x, w13, w2, weights, ids, mode=mode, block_k=64, **kw)
    want = ref.experts_forward(x, w13, w2, weights, ids, **kw)
    _check(got, want, dtype)


# the smallest and the largest split, with and without prefetch (13-19 s a case under the interpreter)
@pytest.mark.parametrize("split,prefetch", [(2, False), (8, True)])
def test_gemv_row_splits_match_the_reference(split, prefetch):
    """The gemv mode with several weight rows per thread (row_split) and weights loaded a step
    ahead (prefetch): rows of a program come as split blocks, a wrong block offset swaps output
    rows; 96 and 160 rows with 64 a program leave a partial block at the end (masked rows); 160
    columns in steps of 32 run five steps, so a prefetch of the wrong step shows."""
    g = torch.Generator().manual_seed(8)
    t, k, e, inter, l = 3, 2, 4, 96, 160
    w13, w2 = _experts(e, inter, l, g)
    weights, ids = _routing(t, k, e, g)
    x = torch.randn(t, l, generator=g).to(torch.bfloat16)
    kw = {"activation": "situ", "beta": 4.0}
    got = kernel.experts_forward(x, w13, w2, weights, ids, mode="gemv", block_n=64, block_k=32, row_split=split,
                                 prefetch=prefetch, **kw)
    _check(got, ref.experts_forward(x, w13, w2, weights, ids, **kw), torch.bfloat16)


def test_gemv_rejects_a_row_split_that_does_not_divide_the_block():
    g = torch.Generator().manual_seed(8)
    w13, w2 = _experts(2, 32, 64, g)
    x, ids, weights = torch.randn(1, 64, generator=g), torch.tensor([[0]]), torch.ones(1, 1)
    with pytest.raises(ValueError, match="power of two"):
        kernel.experts_forward(x, w13, w2, weights, ids, activation="silu", mode="gemv", block_n=16, row_split=3)


@pytest.mark.parametrize("act", [("situ", 4.0, None), ("situ", 4.0, 8.0), ("silu", None, None)],
                         ids=["situ", "situ_linear_beta", "silu"])
def test_dequant_mode_matches_the_reference(act):
    """The prefill mode (moe_mxfp4_dequant.py): bf16 activations, an expert with every token,
    one with none, a token naming an expert twice, and ids of another rank's experts."""
    activation, beta, linear_beta = act
    g = torch.Generator().manual_seed(3)
    t, k, e, inter, l = 9, 3, 6, 64, 96
    w13, w2 = _experts(e, inter, l, g)
    weights, ids = _routing(t, k, e + 2, g)
    ids[:, 0] = 4
    ids[0, 1] = 4                                    # token 0 names expert 4 twice
    ids[ids == 1] = 0                                # expert 1 gets no token
    x = torch.randn(t, l, generator=g).bfloat16()
    kw = {"activation": activation, "beta": beta, "linear_beta": linear_beta}
    got = kernel.experts_forward(x, w13, w2, weights, ids, mode="dequant", **kw)
    _check(got, ref.experts_forward(x, w13, w2, weights, ids, **kw), torch.bfloat16)
    with pytest.raises(ValueError, match="dequant take bf16"):
        kernel.experts_forward(x.float(), w13, w2, weights, ids, mode="dequant", **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_expert_is_exact(dtype):
    """One expert's bf16 / fp32 weights equal MXFP4Tensor.dequantize's bit for bit (every MXFP4
    value is a bf16), rows past a program's block and a NaN scale included."""
    from k3.platforms.triton_kernels.moe_mxfp4_dequant import dequantize_expert

    g = torch.Generator().manual_seed(4)
    w = MXFP4Tensor.from_float(torch.randn(3, 37, 320, generator=g) * 100)
    w.scales[1, 5, 2] = 255                                                   # E8M0 NaN
    for e in range(3):
        got, want = dequantize_expert(w, e, dtype), w.dequantize(dtype, index=e)
        assert got.shape == want.shape == (37, 320)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert dequantize_expert(w, 1, dtype)[5, 64:96].isnan().all()


def _nan_poisoned_empty(monkeypatch, module):
    """Make `module`'s torch.empty return NaN-filled float tensors (unwritten memory shows)."""
    empty = torch.empty

    def poisoned(*size, dtype=None, **kw):
        out = empty(*size, dtype=dtype, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(module.torch, "empty", poisoned)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_experts_writes_each_named_expert(dtype, monkeypatch):
    """One launch for any list of experts (repeats and any order): [G, R, C] equal to
    MXFP4Tensor.dequantize's bit for bit in a NaN-poisoned buffer, a NaN scale included."""
    from k3.platforms.triton_kernels import moe_mxfp4_dequant as dequant

    g = torch.Generator().manual_seed(8)
    w = MXFP4Tensor.from_float(torch.randn(4, 37, 320, generator=g) * 100)
    w.scales[1, 5, 2] = 255                                                   # E8M0 NaN
    ids = [3, 1, 1, 0]
    _nan_poisoned_empty(monkeypatch, dequant)
    got = dequant.dequantize_experts(w, torch.tensor(ids, dtype=torch.int32), dtype)
    monkeypatch.undo()
    want = w.dequantize(dtype, index=torch.tensor(ids))
    assert got.shape == want.shape == (4, 37, 320) and got.dtype == dtype
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert int(got.isnan().sum()) == 2 * 32                                  # the NaN group, in both copies of 1
    with pytest.raises(ValueError, match="int32"):
        dequant.dequantize_experts(w, torch.tensor(ids), dtype)


def test_expert_groups_hold_the_active_experts_under_the_byte_cap(monkeypatch):
    from k3.platforms.triton_kernels import moe_mxfp4_dequant as dequant

    counts = [0, 5, 0, 3, 2, 0, 7]
    monkeypatch.setattr(dequant, "GROUP_BYTES", 250)
    assert dequant.expert_groups(counts, 100) == [[1, 3], [4, 6]]
    monkeypatch.setattr(dequant, "GROUP_BYTES", 50)                          # an expert over the cap: one a group
    assert dequant.expert_groups(counts, 100) == [[1], [3], [4], [6]]
    monkeypatch.setattr(dequant, "GROUP_BYTES", 2 << 30)
    assert dequant.expert_groups(counts, 100) == [[1, 3, 4, 6]]
    assert dequant.expert_groups([0, 0], 100) == []


def _dequant_case(seed, t=13, k=3, e_global=10, e_local=6, start=3, inter=32, l=64):
    """An expert-parallel rank's slice (experts start..start+e_local of e_global), routing that
    leaves two of its experts without a token (one between busy ones), names one by every
    token and one twice for token 0."""
    g = torch.Generator().manual_seed(seed)
    w13, w2 = _experts(e_global, inter, l, g)
    weights, ids = _routing(t, k, e_global, g)
    ids[:, 0] = start + 2                                                    # every token
    ids[0, 1] = start + 2                                                    # token 0 names it twice
    for idle in (start + 1, start + 4):
        ids[ids == idle] = start - 1                                         # another rank's expert
    x = torch.randn(t, l, generator=g).bfloat16()
    local13 = MXFP4Tensor(w13.packed[start:start + e_local], w13.scales[start:start + e_local])
    local2 = MXFP4Tensor(w2.packed[start:start + e_local], w2.scales[start:start + e_local])
    return x, local13, local2, weights, ids, start


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "mm_loop"])
@pytest.mark.parametrize("per_group", [None, 2, 1], ids=["one_group", "groups_of_2", "groups_of_1"])
def test_dequant_mode_groups_match_the_reference(per_group, grouped, monkeypatch):
    """The dequant mode over an expert-parallel slice (expert_start 3), cut into one group, groups
    of two or of one expert by the byte cap, with torch._grouped_mm or the loop of products:
    each against the reference, in NaN-poisoned buffers; one dequantising launch per weight and
    group, for the active experts only."""
    from k3.platforms.triton_kernels import moe_mxfp4_dequant as dequant

    if grouped and not dequant.grouped_mm_runs(torch.device("cpu"), torch.bfloat16):
        pytest.skip("torch._grouped_mm does not run here")
    x, w13, w2, weights, ids, start = _dequant_case(9)
    e_local, two_i, l = w13.shape
    expert_bytes = 2 * (two_i * l + l * two_i // 2)
    if per_group:
        monkeypatch.setattr(dequant, "GROUP_BYTES", per_group * expert_bytes + expert_bytes // 2)
    monkeypatch.setattr(dequant, "grouped_mm_runs", lambda device, dtype: grouped)
    launched, dequantize = [], dequant.dequantize_experts

    def spy(w, ids_dev, *a, **k):
        launched.append(ids_dev.tolist())
        return dequantize(w, ids_dev, *a, **k)

    monkeypatch.setattr(dequant, "dequantize_experts", spy)
    _nan_poisoned_empty(monkeypatch, dequant)
    kw = {"activation": "situ", "beta": 4.0, "linear_beta": 8.0}
    got = kernel.experts_forward(x, w13, w2, weights, ids, mode="dequant", expert_start=start, **kw)
    monkeypatch.undo()
    active = [0, 2, 3, 5]                                                     # local experts 1 and 4 idle
    assert sorted({e for e in ids.flatten().tolist() if start <= e < start + e_local}) == [start + e for e in active]
    size = per_group or len(active)
    groups = [active[i: i + size] for i in range(0, len(active), size)]
    assert launched == [ids_ for group in groups for ids_ in (group, group)]      # w13 then w2, per group
    want = ref.experts_forward(x, w13, w2, weights, ids, expert_start=start, **kw)
    assert got.isfinite().all()
    _check(got, want, torch.bfloat16)


def test_grouped_mm_and_the_loop_of_products_agree():
    """The two product paths over one dequantised group buffer and the same offsets, where
    torch._grouped_mm runs: the same bf16 rounding of fp32 sums (both against fp64)."""
    from k3.platforms.triton_kernels import moe_mxfp4_dequant as dequant

    if not dequant.grouped_mm_runs(torch.device("cpu"), torch.bfloat16):
        pytest.skip("torch._grouped_mm does not run here")
    g = torch.Generator().manual_seed(10)
    a = torch.randn(40, 64, generator=g).bfloat16()                           # [n, K]
    w = torch.randn(3, 96, 64, generator=g).bfloat16()                        # [G, N, K]
    ends = [7, 8, 40]
    ends_dev = torch.tensor(ends, dtype=torch.int32)
    fast = dequant.grouped_matmul(a, w, ends, ends_dev, grouped=True)
    loop = dequant.grouped_matmul(a, w, ends, ends_dev, grouped=False)
    want = torch.cat([a[s:e].double() @ w[i].double().T for i, (s, e) in enumerate(zip([0] + ends, ends))])
    for got in (fast, loop):
        assert got.dtype == torch.bfloat16 and got.shape == (40, 96)
        torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(fast, loop, rtol=2 ** -7, atol=0)


def test_grouped_mm_that_raises_or_is_wrong_falls_back_to_the_loop(monkeypatch):
    """grouped_mm_runs tries the op once per (device, dtype): one that raises, one that
    returns wrong rows and a torch without it all fall back to the loop, and the mode still
    matches the reference."""
    from k3.platforms.triton_kernels import moe_mxfp4_dequant as dequant

    cpu = torch.device("cpu")
    real = getattr(torch, "_grouped_mm", None)

    def raises(*a, **kw):
        raise RuntimeError("grouped gemm is not supported on your system")

    def wrong(a, b, offs=None, **kw):
        return real(a, b, offs=offs).flip(0)

    for fake in (raises, None) if real is None else (raises, wrong, None):
        monkeypatch.setattr(dequant, "_GROUPED_MM_RUNS", {})
        if fake is None:                                                      # a torch without the op
            monkeypatch.delattr(torch, "_grouped_mm", raising=False)
        else:
            monkeypatch.setattr(torch, "_grouped_mm", fake, raising=False)
        assert not dequant.grouped_mm_runs(cpu, torch.bfloat16)
        assert dequant._GROUPED_MM_RUNS == {(cpu, torch.bfloat16): False}
        x, w13, w2, weights, ids, start = _dequant_case(11)
        got = kernel.experts_forward(x, w13, w2, weights, ids, activation="silu", mode="dequant", expert_start=start)
        _check(got, ref.experts_forward(x, w13, w2, weights, ids, activation="silu", expert_start=start),
               torch.bfloat16)
        monkeypatch.undo()


def test_dequant_mode_with_no_token_on_this_rank_is_zero():
    x, w13, w2, weights, ids, start = _dequant_case(12)
    got = kernel.experts_forward(x, w13, w2, weights, ids.clamp(max=start - 1), activation="silu", mode="dequant",
                                 expert_start=start)
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.zeros_like(x))


def test_expert_tiles_cover_each_experts_pairs_once():
    """Each expert with pairs gets ceil(count / block_t) neighbouring tiles at offsets 0,
    block_t, ...; the rest of the worst-case grid points at expert E (count 0)."""
    counts = torch.tensor([0, 5, 33, 16, 0], dtype=torch.int32)
    tile_expert, tile_start = kernel.expert_tiles(counts, 16, int(counts.sum()))
    assert tile_expert.numel() == -(-54 // 16) + 5
    busy = tile_expert < 5
    assert tile_expert[busy].tolist() == [1, 2, 2, 2, 3]
    assert tile_start[busy].tolist() == [0, 0, 16, 32, 0]
    assert (tile_expert[~busy] == 5).all() and (tile_start[~busy] == 0).all()


@pytest.mark.parametrize("block_t", [16, 32])
def test_an_expert_spanning_many_token_tiles(block_t):
    """Prefill-sized loads: 70 tokens over 4 experts, one expert named by every token, so an
    expert's pairs span several tiles, the last part-filled; the tensor-core grid path."""
    g = torch.Generator().manual_seed(7)
    t, k, e, inter, l = 70, 2, 4, 32, 64
    w13, w2 = _experts(e, inter, l, g)
    weights, ids = _routing(t, k, e, g)
    ids[:, 0] = 3
    ids[:, 1] = torch.where(ids[:, 1] == 3, torch.zeros_like(ids[:, 1]), ids[:, 1])
    x = torch.randn(t, l, generator=g)
    kw = {"activation": "situ", "beta": 4.0}
    got = kernel.experts_forward(x, w13, w2, weights, ids, mode="decode", block_t=block_t, **kw)
    _check(got, ref.experts_forward(x, w13, w2, weights, ids, **kw), torch.float32)


@pytest.mark.parametrize("mode", ["decode", "gemv"])
def test_a_token_naming_an_expert_twice_counts_twice(mode):
    """Routing ids need not be distinct: 20 tokens that all name expert 1 twice give it 40
    routed rows, more than the grid's token blocks hold (the kernels loop over the rest)."""
    g = torch.Generator().manual_seed(5)
    t, e, inter, l = 20, 3, 32, 64
    w13, w2 = _experts(e, inter, l, g)
    ids = torch.tensor([[1, 1, 0]]).repeat(t, 1)
    weights = torch.rand(t, 3, generator=g)
    x = torch.randn(t, l, generator=g)
    kw = {"activation": "situ", "beta": 4.0}
    got = kernel.experts_forward(x, w13, w2, weights, ids, mode=mode, block_t=16, **kw)
    _check(got, ref.experts_forward(x, w13, w2, weights, ids, **kw), torch.float32)


def _bench_decode_check():
    """bench/moe_bf16_decode_check.py, the GPU check of the same decode, as a module."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "moe_bf16_decode_check.py"
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))                  # its `measure` import, as `python3 bench/...` finds it
    spec = importlib.util.spec_from_file_location("bench_moe_bf16_decode_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bf16_decode_is_exact_for_every_code_and_scale():
    """decode_bf16's in-kernel decode (its interpreter form: the fp32 decode rounded to bf16;
    the PTX forms are checked on the GPU by bench/moe_bf16_decode_check.py, whose kernel and
    codes this runs) gives the MXFP4 value exactly, as bf16, for all 256 code bytes under every
    E8M0 scale code from the bottom of the range (code 0: 2^-127, a bf16 subnormal) to the top
    (254; products past bf16's range are inf, as the fp32 dequantisation then rounded to bf16
    gives) and NaN (255), into NaN-poisoned outputs."""
    check = _bench_decode_check()
    packed, scales = check.codes("cpu")
    want = MXFP4Tensor(packed, scales).dequantize(torch.float32).to(torch.bfloat16)
    got = check.decoded(packed, scales, 64, False, False)
    same = check.same_bits(got, want)
    assert same.all(), (got[~same][:8], want[~same][:8])
    assert got.isinf().any() and got.isnan().any() and (got == 0).any()   # the ends were exercised


@pytest.mark.parametrize("act", ["situ_linear_beta", "silu"])
def test_bf16_decode_mode_matches_the_reference(act):
    """decode_bf16 (the bf16 tensor-core tiles without dot_scaled): bf16 activations, an expert
    with every token, some with none, the token tile smaller than an expert's load."""
    activation, beta, linear_beta = ACTIVATIONS[act]
    g = torch.Generator().manual_seed(11)
    t, k, e, inter, l = 21, 3, 6, 64, 96
    w13, w2 = _experts(e, inter, l, g)
    weights, ids = _routing(t, k, e, g)
    ids[:, 0] = 2
    x = torch.randn(t, l, generator=g).to(torch.bfloat16)
    kw = {"activation": activation, "beta": beta, "linear_beta": linear_beta}
    got = kernel.experts_forward(x, w13, w2, weights, ids, mode="decode_bf16", block_k=64, block_t=16, block_n=32, **kw)
    _check(got, ref.experts_forward(x, w13, w2, weights, ids, **kw), torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 activations"):
        kernel.experts_forward(x.float(), w13, w2, weights, ids, mode="decode_bf16", **kw)


@pytest.mark.parametrize("mode", ["decode", "gemv"])
def test_scales_near_the_top_of_the_e8m0_range_stay_finite(mode):
    """Weights of magnitude 2^120 (E8M0 scale codes near 247): every intermediate of the kernel
    must stay inside fp32 (the gemv mode once folded 2^14 into the scale and overflowed)."""
    g = torch.Generator().manual_seed(6)
    w13, w2 = _experts(2, 32, 64, g)
    w2 = MXFP4Tensor.from_float(w2.dequantize() * 2.0 ** 120)
    assert int(w2.scales.max()) > 241
    x = torch.randn(2, 64, generator=g)
    ids, weights = torch.tensor([[0], [1]]), torch.ones(2, 1)
    got = kernel.experts_forward(x, w13, w2, weights, ids, activation="silu", mode=mode, block_k=64)
    want = ref.experts_forward(x, w13, w2, weights, ids, activation="silu")
    assert want.isfinite().all()
    _check(got, want, torch.float32)


def test_gemv_falls_back_when_codes_are_not_word_aligned():
    """Packed codes at an odd byte offset cannot be read as 32-bit words: the gemv request runs
    the byte-wise decode mode instead, with the same result."""
    g = torch.Generator().manual_seed(7)
    w13, w2 = _experts(2, 32, 64, g)
    buffer = torch.zeros(w13.packed.numel() + 1, dtype=torch.uint8)
    shifted = buffer[1:].view(w13.packed.shape)
    shifted.copy_(w13.packed)
    odd = MXFP4Tensor(shifted, w13.scales)
    assert not kernel.moe_mxfp4_gemv.word_aligned(odd, w2)
    x, ids, weights = torch.randn(2, 64, generator=g), torch.tensor([[0], [1]]), torch.ones(2, 1)
    got = kernel.experts_forward(x, odd, w2, weights, ids, activation="silu", mode="gemv", block_k=64)
    _check(got, ref.experts_forward(x, w13, w2, weights, ids, activation="silu"), torch.float32)


def _tokens(item) -> int:
    """The batch size a moe.experts sample's name starts with ("T1024_E8_..." -> 1024)."""
    return int(re.match(r"(?:\w+?_)?T(\d+)_", item.sample.shape).group(1))


DECODE_BATCH_MAX = 64      # the largest decode batch a sample of the gemv test has


@pytest.mark.parametrize("item", [i for i in samples("moe.experts") if _tokens(i) <= DECODE_BATCH_MAX],
                         ids=lambda i: i.id)
def test_conformance_samples_in_the_gemv_mode(item):
    """The gemv mode serves bf16 decode batches on the GPU, where the interpreter's default
    (decode) mode does not run: every moe.experts sample of a decode batch's size through it
    (the prefill-sized ones, 1,024 tokens and up, take the interpreter many minutes each in this
    mode and are never served by it)."""
    gemv = functools.partial(kernel.experts_forward, mode="gemv", block_k=64)
    outcome = run_with(item, "moe", experts=gemv)
    assert outcome.passed, outcome.summary()



def test_gemv_reads_each_nibble_of_each_word_in_its_column():
    """The gemv mode reads packed codes as 32-bit words and pairs nibbles c and c + 4 of each:
    a weight that is zero except one code at each column position in turn must give exactly
    that column of x times the code's value (a wrong pairing moves it to another column)."""
    g = torch.Generator().manual_seed(4)
    inter, l = 32, 64
    x = torch.randn(1, l, generator=g)
    for col in (0, 1, 3, 4, 6, 7, 8, 13, 31, 32, 63):
        w13 = torch.zeros(1, 2 * inter, l)
        w13[0, :inter, col] = 6.0                                  # gate rows: code 6.0 (0b0111) at col
        w13[0, inter:, col] = -0.5                                 # up rows: code -0.5 (0b1001)
        w2 = torch.zeros(1, l, inter)
        w2[0, :, 5] = 1.0
        q13, q2 = MXFP4Tensor.from_float(w13), MXFP4Tensor.from_float(w2)
        ids, weights = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
        got = kernel.experts_forward(x, q13, q2, weights, ids, activation="silu", mode="gemv", block_k=64)
        want = ref.experts_forward(x, q13, q2, weights, ids, activation="silu")
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_expert_parallel_ranks_sum_to_the_whole():
    g = torch.Generator().manual_seed(1)
    t, k, e, inter, l = 17, 4, 8, 32, 64             # 17 tokens: two token blocks per busy expert
    w13, w2 = _experts(e, inter, l, g)
    weights, ids = _routing(t, k, e, g)
    x = torch.randn(t, l, generator=g)
    kw = {"activation": "situ", "beta": 4.0}
    whole = ref.experts_forward(x, w13, w2, weights, ids, **kw)
    parts = []
    for start in (0, 4):
        local13 = MXFP4Tensor(w13.packed[start:start + 4], w13.scales[start:start + 4])
        local2 = MXFP4Tensor(w2.packed[start:start + 4], w2.scales[start:start + 4])
        got = kernel.experts_forward(x, local13, local2, weights, ids, expert_start=start, **kw)
        _check(got, ref.experts_forward(x, local13, local2, weights, ids, expert_start=start, **kw), torch.float32)
        parts.append(got)
    _check(parts[0] + parts[1], whole, torch.float32)


def test_nan_scale_propagates_and_dense_weights_fall_back():
    g = torch.Generator().manual_seed(2)
    w13, w2 = _experts(2, 32, 32, g)
    w13.scales[1, 0, 0] = 255                       # E8M0 NaN in expert 1
    x, weights = torch.randn(2, 32, generator=g), torch.ones(2, 1)
    ids = torch.tensor([[0], [1]])
    got = kernel.experts_forward(x, w13, w2, weights, ids, activation="silu")
    assert got[0].isfinite().all() and got[1].isnan().any()
    dense13 = w13.dequantize()
    assert not kernel.covers(x, dense13, w2, "silu")


def test_prefill_batches_take_64_token_tiles_on_the_tensor_cores_only():
    """dot_scaled prefill tiles hold 64 tokens (the H200 sweep); the fp32 in-kernel decoding
    keeps the 16-token tiles its device conformance ran with (not swept at 64)."""
    assert kernel.launch_options(8192, "dot_scaled")["block_t"] == 64
    assert kernel.launch_options(8192, "decode")["block_t"] == 16
    assert kernel.launch_options(64, "dot_scaled")["block_t"] == 16
    x = torch.empty(kernel.DEQUANT_MIN_TOKENS, 8, dtype=torch.bfloat16)
    assert kernel.default_mode(x) == "decode"                 # on the CPU: no dot_scaled, no cuBLAS


@pytest.mark.parametrize("chain", [1, 4])
def test_gemv_fp16x2_form_holds_groups_of_any_magnitude(chain, monkeypatch):
    """bf16 activations in the gemv mode are multiplied as fp16 pairs, each 32-column group
    scaled by its own power of two: groups 2^-40 to 2^40 apart, an all-zero group and a token
    of tiny values must all keep bf16-level accuracy (one fp16 scale per row would flush the
    small groups or overflow the large ones). NaN-poisoned buffers: every pair plane, group
    unscale and activation row is written (96 rows in blocks of 64 leave a part-empty block)."""
    from k3.platforms.triton_kernels import moe_mxfp4_gemv as gemv

    g = torch.Generator().manual_seed(12)
    t, k, e, inter, l = 3, 2, 4, 96, 160
    w13, w2 = _experts(e, inter, l, g)
    weights, ids = _routing(t, k, e, g)
    x = torch.randn(t, l, generator=g)
    x[0] *= (2.0 ** torch.arange(-40, 41, 16).repeat_interleave(32)[:l]).float()    # groups 2^-40 .. 2^24
    x[1, 32:64] = 0
    x[2] *= 2.0 ** -30                                      # activations near 2^-60: act groups far below 1
    x = x.bfloat16()
    kw = {"activation": "silu"}
    _nan_poisoned_empty(monkeypatch, gemv)
    got = kernel.experts_forward(x, w13, w2, weights, ids, mode="gemv", block_n=64, block_k=64, chain=chain, half=True,
                                 **kw)
    monkeypatch.undo()
    want = ref.experts_forward(x.double(), w13, w2, weights.double(), ids, **kw)
    assert got.isfinite().all()
    for row in range(t):                                    # each token against its own scale
        err = (got[row].double() - want[row]).norm() / want[row].norm()
        assert err < 1e-2, (row, err)


def test_gemv_fp16x2_form_propagates_nan_and_checks_its_options():
    g = torch.Generator().manual_seed(13)
    w13, w2 = _experts(2, 32, 64, g)
    x, ids, weights = torch.randn(2, 64, generator=g).bfloat16(), torch.tensor([[0], [1]]), torch.ones(2, 1)
    x[1, 5] = float("nan")
    got = kernel.experts_forward(x, w13, w2, weights, ids, activation="silu", mode="gemv", block_k=64, half=True)
    assert got[0].isfinite().all() and got[1].isnan().any()
    with pytest.raises(ValueError, match="multiple of 32"):
        kernel.experts_forward(x, w13, w2, weights, ids, activation="silu", mode="gemv", block_n=16, row_split=1,
                               half=True)
    with pytest.raises(ValueError, match="chain 1 or 4"):
        kernel.experts_forward(x, w13, w2, weights, ids, activation="silu", mode="gemv", chain=2, half=True)


def test_hfma2_emulation_rounds_as_the_instruction():
    """The interpreter's stand-in for fma.rn.f16x2: both halves of a * b + c rounded once to fp16
    (nearest even), against numpy's fp16 on exact products."""
    import numpy as np

    rng = np.random.default_rng(0)
    n = 256
    # a: E2M1 values / 2^14 (at most 2 significant bits), b: fp16 of at most 8 (exact products)
    a = (rng.choice([0, .5, 1, 1.5, 2, 3, 4, 6], (n, 2)) * rng.choice([-1, 1], (n, 2)) / 2 ** 14).astype(np.float16)
    b = (np.round(rng.normal(size=(n, 2)) * 128) * 2.0 ** rng.integers(0, 8, (n, 2))).astype(np.float16)
    c = rng.normal(size=(n, 2)).astype(np.float16) * 8
    as_words = lambda v: torch.from_numpy(v.view(np.int32).reshape(n).copy())  # noqa: E731
    out = torch.empty(n, dtype=torch.int32)
    _hfma2_kernel[(1,)](as_words(a), as_words(b), as_words(c), out, N=n)
    want = (a.astype(np.float64) * b + c).astype(np.float16)              # exact product and sum, one rounding
    assert np.array_equal(out.numpy().view(np.float16).reshape(n, 2), want)


def test_gemv_grouped_equals_the_gemv_bit_for_bit(monkeypatch):
    """The gemv_grouped mode decodes each weight tile once for up to 8 pairs of its expert and must
    give exactly the gemv mode's fp16x2 result as it was served before issue 32 (same steps, same
    order; K3_LEGACY_ROUNDING restores that form of the gemv). 10 tokens all name expert 1 (a tile of 8 and a part-filled one:
    every slot of the unrolled kernel and the masked ones), one token names expert 2 twice, and
    this rank holds experts 1-3 of 4 (expert 0's pairs belong to no tile: their rows stay zero).
    NaN-poisoned buffers: every activation row a tile owns is written."""
    from k3.platforms.triton_kernels import moe_mxfp4_gemv_grouped as grouped

    g = torch.Generator().manual_seed(21)
    t, k, e, inter, l = 10, 2, 4, 32, 64
    w13, w2 = _experts(e, inter, l, g)
    local13, local2 = (MXFP4Tensor(w.packed[1:], w.scales[1:]) for w in (w13, w2))
    weights, ids = _routing(t, k, e, g)
    ids[:, 0] = 1
    ids[3] = torch.tensor([2, 2])
    x = torch.randn(t, l, generator=g).bfloat16()
    kw = {"activation": "situ", "beta": 4.0, "linear_beta": 8.0, "expert_start": 1, "block_n": 32, "block_k": 32,
          "row_split": 4, "chain": 4}
    monkeypatch.setenv("K3_LEGACY_ROUNDING", "1")
    want = kernel.experts_forward(x, local13, local2, weights, ids, mode="gemv", **kw)
    monkeypatch.delenv("K3_LEGACY_ROUNDING")
    _nan_poisoned_empty(monkeypatch, grouped)
    got = kernel.experts_forward(x, local13, local2, weights, ids, mode="gemv_grouped", group_tokens=8, **kw)
    monkeypatch.undo()
    assert torch.equal(got, want)
    reference = ref.experts_forward(x.double(), local13, local2, weights.double(), ids, activation="situ", beta=4.0,
                                    linear_beta=8.0, expert_start=1)
    _check(got.double(), reference, torch.bfloat16)


def test_gemv_grouped_checks_its_options():
    from k3.platforms.triton_kernels import moe_mxfp4_gemv_grouped as grouped

    g = torch.Generator().manual_seed(22)
    w13, w2 = _experts(2, 32, 64, g)
    x, ids, weights = torch.randn(2, 64, generator=g).bfloat16(), torch.tensor([[0], [1]]), torch.ones(2, 1)
    common = dict(activation="silu", beta=None, linear_beta=None, expert_start=0, block_n=32, block_k=32,
                  num_warps=4)
    with pytest.raises(ValueError, match="tokens 3 is not one of"):
        grouped.experts_forward(x, w13, w2, weights, ids, tokens=3, **common)
    with pytest.raises(ValueError, match="bf16 activations"):
        grouped.experts_forward(x.float(), w13, w2, weights, ids, tokens=2, **common)
    with pytest.raises(ValueError, match="multiple of 32"):
        grouped.experts_forward(x, w13, w2, weights, ids, tokens=2, **{**common, "block_n": 16}, split=1)
    with pytest.raises(ValueError, match="take bf16 activations"):
        kernel.experts_forward(x.float(), w13, w2, weights, ids, activation="silu", mode="gemv_grouped")


def test_the_bf16_entry_takes_decode_bf16_where_dot_scaled_would_serve(monkeypatch):
    """nvidia's promoted `moe_experts_bf16`: batches `default_mode` gives to dot_scaled, and
    gemv batches from BF16_DECODE_MIN_TOKENS, go to decode_bf16 (its tile, BF16_DECODE_TILE), every
    other batch to the default mode."""
    g = torch.Generator().manual_seed(12)
    w13, w2 = _experts(4, 32, 64, g)
    weights, ids = _routing(18, 2, 4, g)
    x = torch.randn(18, 64, generator=g).to(torch.bfloat16)
    modes = []
    forward = kernel.experts_forward
    monkeypatch.setattr(kernel, "experts_forward", lambda *a, **k: modes.append(k.get("mode")) or forward(*a, **k))
    monkeypatch.setattr(kernel, "BF16_DECODE_TILE", dict(block_t=16, block_n=32, block_k=32, num_warps=4, stages=2))
    got = kernel.experts_forward_bf16_decode(x, w13, w2, weights, ids, activation="silu")      # interpreter: decode
    monkeypatch.setattr(kernel, "default_mode", lambda x: "dot_scaled")
    got_bf16 = kernel.experts_forward_bf16_decode(x, w13, w2, weights, ids, activation="silu")
    monkeypatch.setattr(kernel, "default_mode", lambda x: "gemv")       # the gemv's range, from 16 tokens
    kernel.experts_forward_bf16_decode(x, w13, w2, weights, ids, activation="silu")
    kernel.experts_forward_bf16_decode(x[:15], w13, w2, weights[:15], ids[:15], activation="silu")
    assert modes == [None, "decode_bf16", "decode_bf16", None]
    want = ref.experts_forward(x, w13, w2, weights, ids, activation="silu")
    _check(got, want, torch.bfloat16)
    _check(got_bf16, want, torch.bfloat16)


def test_folding_is_safe_only_when_every_scale_code_is_at_most_128():
    """decode_bf16's folded PTX multiplies by 2^(code - 1), a bf16 only up to code 128:
    `folding_safe` reads each scales tensor once per version and refuses any stack with a larger
    code."""
    g = torch.Generator().manual_seed(13)
    w13, w2 = _experts(2, 32, 64, g)
    assert kernel.folding_safe(w13, w2)                         # randn / sqrt(n): codes near 120
    big = MXFP4Tensor(w2.packed, w2.scales.clone())
    big.scales[1, 3, 0] = 129
    assert not kernel.folding_safe(w13, big)
    assert getattr(big.scales, kernel._MAX_CODE_ATTR)[1] == 129
    big.scales[1, 3, 0] = 100                                   # written in place: read again
    assert kernel.folding_safe(big)
    with torch.no_grad():
        w2.scales.copy_(w2.scales.clone().fill_(200))           # a checkpoint loaded after the first call
    assert not kernel.folding_safe(w13, w2)


def _tileable_experts(g):
    """Three experts whose stacks divide into moe_mxfp4_layout's tiles (128 rows x 64 columns)."""
    return _experts(3, 64, 128, g)


def test_the_tile_major_layout_round_trips_and_dequantises_alike():
    """k3.quant.mxfp4_tiles: each 128-row x 64-column tile's codes (4 KB) and scales contiguous,
    the same weights whole or by expert as the checkpoint layout, back to it exactly; stacks that
    do not divide into tiles are refused."""
    from k3.quant.mxfp4_tiles import TileMajorMXFP4, tileable, to_tile_major

    g = torch.Generator().manual_seed(14)
    w13, w2 = _tileable_experts(g)
    tiles = to_tile_major(w13)
    assert isinstance(tiles, TileMajorMXFP4) and isinstance(tiles, MXFP4Tensor) and tiles.shape == w13.shape
    assert tiles.packed.shape == (3, 1, 2, 128, 32) and tiles.scales.shape == (3, 1, 2, 128, 2)
    assert torch.equal(tiles.packed[1, 0, 1, 5], w13.packed[1, 5, 32:64])           # row 5, columns 64..127
    assert torch.equal(tiles.scales[2, 0, 1, 7], w13.scales[2, 7, 2:4])
    back = tiles.checkpoint_layout()
    assert torch.equal(back.packed, w13.packed) and torch.equal(back.scales, w13.scales)
    assert torch.equal(tiles.dequantize(torch.float32), w13.dequantize(torch.float32))
    for index in (2, [2, 0], torch.tensor([1])):
        assert torch.equal(tiles.dequantize(torch.bfloat16, index=index), w13.dequantize(torch.bfloat16, index=index))
    assert not tileable(tiles)                                                       # already tile-major
    small, _ = _experts(2, 32, 64, g)                                                # 64 rows: no whole tile
    assert not tileable(small)
    with pytest.raises(ValueError, match="N % 128 == 0"):
        to_tile_major(small)
    with pytest.raises(ValueError, match="TileMajorMXFP4: expected packed"):
        TileMajorMXFP4(w13.packed, w13.scales)


@pytest.mark.parametrize("mode", ["decode", "decode_bf16"])
def test_the_tiled_copy_and_the_load_pipeline_change_no_bit(mode):
    """The tensor-core tiles read the tiled copy (row tiles of 128 and 64, steps of 64 and 32
    columns, scale codes loaded a step ahead or in the step) and load with and without the
    pipelined scale / activation loads, bit for bit the checkpoint layout's result, which is the
    reference's within the dtype's tolerance."""
    from k3.quant.mxfp4_tiles import to_tile_major

    g = torch.Generator().manual_seed(15)
    w13, w2 = _tileable_experts(g)
    weights, ids = _routing(19, 2, 3, g)
    dtype = torch.bfloat16 if mode == "decode_bf16" else torch.float32
    x = torch.randn(19, 128, generator=g).to(dtype)
    t13, t2 = to_tile_major(w13), to_tile_major(w2)
    kw = {"activation": "situ", "beta": 4.0, "mode": mode, "block_t": 16, "num_warps": 4}
    for block_n, block_k in ((128, 64), (64, 32)):
        base = kernel.experts_forward(x, w13, w2, weights, ids, block_n=block_n, block_k=block_k, **kw)
        _check(base, ref.experts_forward(x, w13, w2, weights, ids, activation="situ", beta=4.0), dtype)
        for experts, options in (((t13, t2), {}), ((t13, t2), dict(scales_ahead=False)),
                                 ((w13, w2), dict(pipelined_loads=False))):
            got = kernel.experts_forward(x, *experts, weights, ids, block_n=block_n, block_k=block_k, **options, **kw)
            assert torch.equal(got, base), (block_n, block_k, experts[0] is t13, list(options))
    with pytest.raises(ValueError, match="need block_n dividing 128 and block_k 64"):
        kernel.experts_forward(x, t13, t2, weights, ids, block_n=256, block_k=64, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gemv_reads_the_tiled_copy_bit_for_bit(dtype):
    """The gemv mode on the tiled copy (a step's 16 groups across 8 column tiles, rows in one
    row tile, with and without prefetch) gives the checkpoint layout's result bit for bit."""
    from k3.quant.mxfp4_tiles import to_tile_major

    g = torch.Generator().manual_seed(17)
    w13, w2 = _tileable_experts(g)
    weights, ids = _routing(3, 2, 3, g)
    x = torch.randn(3, 128, generator=g).to(dtype)
    t13, t2 = to_tile_major(w13), to_tile_major(w2)
    kw = {"activation": "situ", "beta": 4.0, "mode": "gemv", "block_n": 32, "block_k": 128, "row_split": 4}
    for prefetch in (False, True):
        base = kernel.experts_forward(x, w13, w2, weights, ids, prefetch=prefetch, **kw)
        _check(base, ref.experts_forward(x, w13, w2, weights, ids, activation="situ", beta=4.0), dtype)
        assert torch.equal(kernel.experts_forward(x, t13, t2, weights, ids, prefetch=prefetch, **kw), base)
    with pytest.raises(ValueError, match="block_k a multiple of 64"):
        kernel.experts_forward(x, t13, t2, weights, ids, **{**kw, "block_k": 32})


def test_the_dequant_mode_reads_the_tiled_copy_bit_for_bit(monkeypatch):
    """The prefill dequant mode dequantises the tiled copy to the same bf16 experts, and so gives
    the checkpoint layout's result bit for bit."""
    from k3.platforms.triton_kernels import moe_mxfp4_dequant as dequant
    from k3.quant.mxfp4_tiles import to_tile_major

    g = torch.Generator().manual_seed(18)
    w13, w2 = _tileable_experts(g)
    t13, t2 = to_tile_major(w13), to_tile_major(w2)
    ids = torch.tensor([2, 0], dtype=torch.int32)
    for w, t in ((w13, t13), (w2, t2)):
        assert torch.equal(dequant.dequantize_experts(t, ids), dequant.dequantize_experts(w, ids))
    weights, choice = _routing(20, 2, 3, g)
    x = torch.randn(20, 128, generator=g).to(torch.bfloat16)
    monkeypatch.setattr(dequant, "grouped_mm_runs", lambda device, dtype: False)       # the CPU: plain products
    kw = {"activation": "situ", "beta": 4.0, "mode": "dequant"}
    base = kernel.experts_forward(x, w13, w2, weights, choice, **kw)
    assert torch.equal(kernel.experts_forward(x, t13, t2, weights, choice, **kw), base)


def test_tile_major_experts_serve_every_mode_bit_for_bit(monkeypatch):
    """Experts repacked tile-major are their own tiles: the experimental bf16 entry and the
    default modes give the checkpoint layout's result bit for bit; the grouped gemv refuses them."""
    from k3.quant.mxfp4_tiles import to_tile_major

    g = torch.Generator().manual_seed(16)
    w13, w2 = _tileable_experts(g)
    t13, t2 = to_tile_major(w13), to_tile_major(w2)
    weights, ids = _routing(17, 2, 3, g)
    x = torch.randn(17, 128, generator=g).to(torch.bfloat16)
    monkeypatch.setattr(kernel, "BF16_DECODE_TILE", dict(block_t=16, block_n=128, block_k=64, num_warps=4, stages=2))
    monkeypatch.setattr(kernel, "default_mode", lambda x: "dot_scaled")          # the entry's decode_bf16 range
    plain = kernel.experts_forward_bf16_decode(x, w13, w2, weights, ids, activation="silu")
    assert torch.equal(kernel.experts_forward_bf16_decode(x, t13, t2, weights, ids, activation="silu"), plain)
    from k3.platforms.triton_kernels import moe_mxfp4_dequant as dequant

    monkeypatch.setattr(dequant, "grouped_mm_runs", lambda device, dtype: False)       # the CPU: plain products
    for mode in ("decode", "gemv", "dequant"):                                          # the entry's other modes
        plain = kernel.experts_forward(x, w13, w2, weights, ids, activation="silu", mode=mode)
        assert torch.equal(kernel.experts_forward(x, t13, t2, weights, ids, activation="silu", mode=mode), plain), mode
    with pytest.raises(ValueError, match="both be tile-major"):
        kernel.experts_forward(x, t13, w2, weights, ids, activation="silu")
    with pytest.raises(ValueError, match="gemv_grouped reads the checkpoint layout"):
        kernel.experts_forward(x, t13, t2, weights, ids, activation="silu", mode="gemv_grouped")
    dense13, dense2 = w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)       # the expert cache's stacks
    got = kernel.experts_forward_bf16_decode(x, dense13, dense2, weights, ids, activation="silu")
    _check(got, ref.experts_forward(x, dense13, dense2, weights, ids, activation="silu"), torch.bfloat16)
