"""W4A16 routed experts in torch (platforms/torch_kernels/moe_w4a16.py, moe_slots.py) against
k3.reference.experts_forward on fresh random experts, MXFP4 and held dense (the expert cache):
routings with empty experts, one token, every pair on one expert, a token naming one expert
twice, ids of other ranks; host and device (dense) dispatch; each way (grouped GEMM, slots,
host); a workspace of one expert (many groups) and of all; the workspace poisoned with NaN
between calls; the device-dispatch ways captured whole by torch.compile(fullgraph=True) (the
CPU proxy for CUDA graphs: any host read breaks the graph, as the host way shows)."""

import pytest
import torch

from k3 import reference as ref
from k3.platforms.torch_kernels.device_support import grouped_gemm_supported
from k3.platforms.torch_kernels.moe_w4a16 import W4A16Experts, build_experts, group_size
from k3.quant.mxfp4 import MXFP4Tensor

E, L, I, K = 6, 64, 32, 2
START = 1                                     # this rank holds global experts 1..6
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
needs_grouped = pytest.mark.skipif(not grouped_gemm_supported("cpu"), reason="this torch build has no CPU "
                                                                              "torch._grouped_mm")


def _experts(seed, held=None):
    """MXFP4 experts, or (held = a dtype) the same experts dequantised: the expert cache."""
    g = torch.Generator().manual_seed(seed)
    w13 = MXFP4Tensor.from_float(torch.randn(E, 2 * I, L, generator=g))
    w2 = MXFP4Tensor.from_float(torch.randn(E, L, I, generator=g) / I ** 0.5)
    return (w13, w2) if held is None else (w13.dequantize(held), w2.dequantize(held))


def _routing(kind, seed):
    g = torch.Generator().manual_seed(seed)
    t = {"one_token": 1, "all_on_one": 9, "two_tokens": 2}.get(kind, 11)
    ids = torch.randint(0, E + 2, (t, K), generator=g)          # 0 and 7: other ranks' experts
    if kind == "empty_experts":
        ids = torch.where(ids % 2 == 0, 3, 6)                   # only two experts used
    if kind == "all_on_one":
        ids = torch.full((t, K), 4)
    if kind == "repeated":
        ids[:, 1] = ids[:, 0]                                   # a token names one expert twice
    return torch.randn(t, L, generator=g), torch.rand(t, K, generator=g), ids.int()


def _error(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-3)).item()


def _call(fn, x, w13, w2, tw, ids, dense, activation="situ"):
    beta = 4.0 if activation == "situ" else None
    return fn(x, w13, w2, tw, ids, activation=activation, beta=beta, expert_start=START, dense_dispatch=dense)


KINDS = ("random", "empty_experts", "one_token", "two_tokens", "all_on_one", "repeated")


@pytest.mark.parametrize("held", [None, "cache"], ids=["mxfp4", "cache"])
@pytest.mark.parametrize("grouped", [False, pytest.param(True, marks=needs_grouped)], ids=["loops", "grouped"])
@pytest.mark.parametrize("dense", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_the_reference(kind, dense, grouped, held):
    x, tw, ids = _routing(kind, seed=hash((kind, dense)) % 89)
    for budget, dtype in ((1, torch.bfloat16), (1 << 30, torch.float32)):    # groups of one expert / all
        w13, w2 = _experts(seed=hash(kind) % 97, held=dtype if held else None)
        fn = W4A16Experts(grouped=grouped, compiled=False, workspace_bytes=budget)
        xd = x.to(dtype)
        want = ref.experts_forward(xd, w13, w2, tw, ids, activation="situ", beta=4.0, expert_start=START)
        got = _call(fn, xd, w13, w2, tw, ids, dense)
        assert got.dtype == dtype and got.shape == want.shape
        assert _error(got, want) < TOL[dtype], (kind, dtype, fn.way(w13, w2, dtype, dense))


def test_the_ways():
    fn = W4A16Experts(grouped=True, compiled=False)
    mx, cache, cache32 = _experts(1), _experts(1, torch.bfloat16), _experts(1, torch.float32)
    assert fn.way(*cache, torch.bfloat16, True) == fn.way(*cache, torch.bfloat16, False) == "grouped"
    assert fn.way(*cache32, torch.float32, True) == "slots" and fn.way(*mx, torch.bfloat16, True) == "slots"
    assert fn.way(*mx, torch.bfloat16, False) == "host"
    loops = W4A16Experts(grouped=False, compiled=False)
    assert loops.way(*cache, torch.bfloat16, True) == "slots" and loops.way(*cache, torch.bfloat16, False) == "host"


@pytest.mark.parametrize("held, dense, kind", [(None, False, "random"), (None, True, "random"),
                                               (None, True, "one_token"), ("cache", True, "one_token")])
def test_a_poisoned_workspace_never_reaches_the_output(held, dense, kind):
    per_expert = 3 * I * L * (4 + 2)                              # fp32 weights + their LUT indices
    fn = W4A16Experts(grouped=False, compiled=False, workspace_bytes=2 * per_expert)
    assert group_size(E, per_expert, 2 * per_expert) == 2
    w13, w2 = _experts(seed=3, held=torch.float32 if held else None)
    _call(fn, *_routing("random", seed=5)[:1], w13, w2, *_routing("random", seed=5)[1:], dense=False)
    x, tw, ids = _routing(kind, seed=6)
    _call(fn, x, w13, w2, tw, ids, dense, activation="silu")                  # the buffers exist now
    (ws13, ws2), = fn.workspace.buffers.values()
    assert ws13.shape == (2, 2 * I, L) and ws2.shape == (2, L, I)             # never the whole expert stack
    ws13.fill_(float("nan")), ws2.fill_(float("nan"))
    got = _call(fn, x, w13, w2, tw, ids, dense, activation="silu")
    assert next(iter(fn.workspace.buffers.values()))[0].data_ptr() == ws13.data_ptr()     # reused, not remade
    want = ref.experts_forward(x, w13, w2, tw, ids, activation="silu", expert_start=START)
    assert got.isfinite().all() and _error(got, want) < 1e-5


@pytest.mark.parametrize("held, grouped", [(None, False), ("cache", False),
                                           pytest.param("cache", True, marks=needs_grouped)])
@pytest.mark.parametrize("kind", ["one_token", "random"])
def test_device_dispatch_captures_whole(held, grouped, kind):
    fn = W4A16Experts(grouped=grouped, compiled=False, workspace_bytes=1)
    w13, w2 = _experts(seed=7, held=torch.bfloat16 if held else None)
    x, tw, ids = _routing(kind, seed=8)
    x = x.bfloat16()

    def step(x, tw, ids, dense=True):
        return _call(fn, x, w13, w2, tw, ids, dense)

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="eager")(x, tw, ids)
    assert torch.equal(got, step(x, tw, ids))
    if fn.way(w13, w2, torch.bfloat16, False) == "host":                   # the check can fail: a host read
        torch._dynamo.reset()
        with pytest.raises(Exception, match="(?i)graph break|data-dependent|tolist|item"):
            torch.compile(lambda *a: step(*a, dense=False), fullgraph=True, backend="eager")(x, tw, ids)


def test_dense_weights_and_the_set_up():
    g = torch.Generator().manual_seed(9)
    w13, w2 = torch.randn(E, 2 * I, L, generator=g), torch.randn(E, L, I, generator=g)
    x, tw, ids = _routing("random", seed=10)
    fn = build_experts("cpu")
    assert fn.compiled is False and fn.grouped == grouped_gemm_supported("cpu")   # no compilation on the CPU
    torch.testing.assert_close(fn(x, w13, w2, tw, ids, activation="situ", beta=4.0, linear_beta=1.0),
                               ref.experts_forward(x, w13, w2, tw, ids, activation="situ", beta=4.0, linear_beta=1.0),
                               rtol=1e-5, atol=1e-4)


@needs_grouped
@pytest.mark.parametrize("dense", [False, True], ids=["host", "device"])
def test_bf16_activations_on_dense_bf16_stacks_take_the_grouped_gemm(dense, monkeypatch):
    """The served call (bf16 activations, the expert cache's bf16 stacks) runs the two grouped
    GEMMs, not the fp32 slot / host products (the H200 profile of 2026-12-05 found the grouped
    way never taken: the entry asked `way` with the fp32 compute dtype)."""
    from k3.platforms.torch_kernels import moe_w4a16
    calls = []
    real = moe_w4a16._grouped_mm
    monkeypatch.setattr(moe_w4a16, "_grouped_mm", lambda a, w, offs: calls.append(a.dtype) or real(a, w, offs))
    fn = W4A16Experts(grouped=True, compiled=False)
    w13, w2 = _experts(seed=11, held=torch.bfloat16)
    x, tw, ids = _routing("random", seed=12)
    got = _call(fn, x.bfloat16(), w13, w2, tw, ids, dense)
    want = ref.experts_forward(x.bfloat16(), w13, w2, tw, ids, activation="situ", beta=4.0, expert_start=START)
    assert calls == [torch.bfloat16, torch.bfloat16]
    assert got.dtype == torch.bfloat16 and _error(got, want) < TOL[torch.bfloat16]


@pytest.mark.parametrize("grouped", [False, pytest.param(True, marks=needs_grouped)], ids=["loops", "grouped"])
@pytest.mark.parametrize("dense", [False, True], ids=["host", "device"])
def test_bf16_activations_on_mxfp4_experts_take_bf16_operands(dense, grouped, monkeypatch):
    """MXFP4 weights are exact in bf16, so bf16 activations dequantise into a bf16 workspace
    (2 bytes a weight, not 4) and take bf16 products; the host way's products are the grouped
    GEMMs where the device has them. fp32 activations keep an fp32 workspace."""
    from k3.platforms.torch_kernels import moe_w4a16
    calls = []
    real = moe_w4a16._grouped_mm
    monkeypatch.setattr(moe_w4a16, "_grouped_mm", lambda a, w, offs: calls.append(a.dtype) or real(a, w, offs))
    w13, w2 = _experts(seed=13)
    x, tw, ids = _routing("random", seed=14)
    for dtype in (torch.bfloat16, torch.float32):
        fn = W4A16Experts(grouped=grouped, compiled=False)
        got = _call(fn, x.to(dtype), w13, w2, tw, ids, dense)
        want = ref.experts_forward(x.to(dtype), w13, w2, tw, ids, activation="situ", beta=4.0, expert_start=START)
        assert {b.dtype for pair in fn.workspace.buffers.values() for b in pair} == {dtype}
        assert got.dtype == dtype and _error(got, want) < TOL[dtype], dtype
    assert calls == ([torch.bfloat16, torch.bfloat16] if grouped and not dense else [])


@needs_grouped
@pytest.mark.parametrize("kind", ["random", "all_on_one", "empty_experts"])
def test_a_large_prefill_runs_the_grouped_gemms_in_bounded_runs_of_rows(kind, monkeypatch):
    """A prefill past `grouped_rows_max` (token, choice) rows runs the grouped way on runs of at
    most that many sorted rows (one host read), so its transient activations stay bounded (an 8K
    prompt on k3-slice ran out of memory in one pass): every pass takes at most the bound, the
    other ranks' pairs are never multiplied, and the output equals the one-pass result bit for
    bit (each row's products do not depend on the run it is in). Decode keeps one pass."""
    from k3.platforms.torch_kernels import moe_w4a16
    w13, w2 = _experts(seed=21, held=torch.bfloat16)
    x, tw, ids = _routing(kind, seed=22)
    x = x.bfloat16()
    one_pass = _call(W4A16Experts(grouped=True, compiled=False), x, w13, w2, tw, ids, dense=False)
    per_row = 24 * (L + I)
    rows = []
    real = moe_w4a16._grouped_mm
    monkeypatch.setattr(moe_w4a16, "_grouped_mm", lambda a, w, offs: rows.append(a.shape[0]) or real(a, w, offs))
    bounded = W4A16Experts(grouped=True, compiled=False, grouped_transient_bytes=5 * per_row)   # 5 rows a pass
    got = _call(bounded, x, w13, w2, tw, ids, dense=False)
    local = ids.long() - START
    live = int(((local >= 0) & (local < E)).sum())
    assert moe_w4a16.grouped_rows_max(L, I, 5 * per_row) == 5
    assert rows[0::2] == [min(5, live - r0) for r0 in range(0, live, 5)]          # gate/up passes: the live rows
    assert torch.equal(got, one_pass)
    rows.clear()
    _call(bounded, x, w13, w2, tw, ids, dense=True)                                # decode: one pass, no host read
    assert rows[0] == ids.numel()


def test_the_compiled_dequantisation_holds_more_experts_a_group():
    """A compiled decoder (`mxfp4_lut.CompiledDecoder`, every form) writes the weights without
    the eager table's int32 indices, so the same workspace holds twice the experts a group in
    bf16 (k3-slice, 512 MiB: 8 instead of 4; half the groups, half the per-group launches). The
    group size is what the workspace buffers are made with."""
    from k3.platforms.torch_kernels.mxfp4_lut import decode_with_tables   # a CompiledDecoder's contract, eager

    w13, w2 = _experts(seed=31)
    x, tw, ids = _routing("random", seed=32)
    per_expert_eager = 3 * I * L * (2 + 2)                        # bf16 weights + their LUT indices
    for lookup, want_g in ((None, 2), (decode_with_tables, 4)):
        fn = W4A16Experts(grouped=False, compiled=False, workspace_bytes=2 * per_expert_eager)
        fn._lookup = lookup
        got = _call(fn, x.bfloat16(), w13, w2, tw, ids, dense=True)
        (ws13, _), = fn.workspace.buffers.values()
        assert ws13.shape[0] == want_g
        want = ref.experts_forward(x.bfloat16(), w13, w2, tw, ids, activation="situ", beta=4.0, expert_start=START)
        assert _error(got, want) < TOL[torch.bfloat16]
