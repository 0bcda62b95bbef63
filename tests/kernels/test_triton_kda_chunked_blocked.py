"""The chunked KDA prefill in Triton (platforms/triton_kernels/kda_chunked_blocked.py over
kda_intra_chunk.py, kda_intra_diagonal.py, kda_chunked_recurrence.py and, where o goes through
the chunk index, kda_chunked_state.py's split recurrence), under the interpreter:
each kernel against the torch code it replaces (strong decays, padded chunks, dimensions that are
not powers of two, NaN-poisoned outputs so unwritten memory shows), every `kda.chunked`
conformance sample with the served wrapper in place of the reference op, and ragged sequences
with initial states and checkpoints against k3.reference.kda_chunked, for the served form (both
phases in Triton) and the previous one (torch phase 1 with the Triton diagonal, in one group and
in many)."""

import functools

import pytest
import torch

from k3 import reference as ref
from k3.platforms.torch_kernels import kda_chunked_blocked as blocked
from kernel_tables import run_with, samples
from kda_chunked_cases import (assert_matches_reference, error_ratio, float64_reference, nan_poisoned_empty,
                               packed_phase1_inputs, random_phase1_outputs, ragged_prefill_inputs)

diag = pytest.importorskip("k3.platforms.triton_kernels.kda_intra_diagonal")
intra = pytest.importorskip("k3.platforms.triton_kernels.kda_intra_chunk")
wrapper = pytest.importorskip("k3.platforms.triton_kernels.kda_chunked_blocked")

# the 300-token multi-chunk sample in bf16 only: the fp32 one took 49 s of CI's 2 cores interpreted
# and takes the kernel path the smaller fp32 samples take (the GPU's conformance runs both dtypes)
CASES = [i for i in samples("kda.chunked", float64=True) if not ("T300" in i.sample.shape and i.dtype == "float32")]


def _qkG(S, HV, C, K, seed, decay=3.0, dtype=torch.float32):
    """q, k, G [S, HV, C, K] laid out as phase 1 gathers them ([S, C, HV, K] permuted), G the
    cumulative sum of log decays in [-decay, 0] with every 7th step -50 (e^-50 per step: the
    exponent masking above the diagonal matters)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(S, C, HV, K, generator=gen).permute(0, 2, 1, 3).to(dtype) for _ in range(2))
    g = -decay * torch.rand(S, HV, C, K, generator=gen)
    g[:, :, ::7] = -50.0
    return q, k, g.cumsum(2).to(dtype)


@pytest.mark.parametrize("C, K, block_k", [(32, 40, 32), (64, 32, 16), (16, 128, 32)])
def test_diagonal_blocks_match_the_torch_einsums(C, K, block_k):
    S, HV = 3, 2
    q, k, G = _qkG(S, HV, C, K, seed=C + K)
    got_kk, got_qk, want_kk, want_qk = (torch.full((S, HV, C, C), float("nan")) for _ in range(4))
    diag.diagonal_blocks(q, k, G, got_kk, got_qk, block_k=block_k)
    blocked.diagonal_blocks_torch(q, k, G, want_kk, want_qk)
    on = torch.block_diag(*[torch.ones(16, 16, dtype=torch.bool)] * (C // 16))      # the diagonal blocks
    for got, want in ((got_kk, want_kk), (got_qk, want_qk)):
        assert got[..., ~on].isnan().all()                                # the rest left untouched
        assert torch.isfinite(got[..., on]).all()
        assert (got[..., on & ~torch.ones(C, C, dtype=torch.bool).tril()] == 0).all()   # 0 above the diagonal
        a, b = got[..., on].double(), want[..., on].double()
        assert (a - b).norm() <= 1e-6 * b.norm() + 1e-6, (a - b).abs().max()


def test_diagonal_blocks_bf16_inputs_and_float64_fallback():
    q, k, G = _qkG(2, 2, 32, 32, seed=5)
    want_kk, want_qk = torch.zeros(2, 2, 32, 32), torch.zeros(2, 2, 32, 32)
    blocked.diagonal_blocks_torch(*(x.bfloat16().float() for x in (q, k)), G, want_kk, want_qk)
    got_kk, got_qk = torch.zeros(2, 2, 32, 32), torch.zeros(2, 2, 32, 32)
    diag.diagonal_blocks(q.bfloat16(), k.bfloat16(), G, got_kk, got_qk)   # bf16 q, k read as fp32
    torch.testing.assert_close(got_kk, want_kk, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_qk, want_qk, rtol=1e-5, atol=1e-5)
    d = [x.double() for x in (q, k, G)]
    got64, want64 = torch.zeros(2, 2, 32, 32, dtype=torch.float64), torch.zeros(2, 2, 32, 32, dtype=torch.float64)
    diag.diagonal_blocks(*d, got64, torch.zeros_like(got64))
    blocked.diagonal_blocks_torch(*d, want64, torch.zeros_like(want64))
    torch.testing.assert_close(got64, want64, rtol=0, atol=0)
    with pytest.raises(ValueError, match="block must be"):
        diag.diagonal_blocks(q, k, G, got_kk, got_qk, block=24)


def test_every_sample_is_collected():
    assert len(CASES) >= 9


@pytest.mark.parametrize("item", CASES, ids=lambda i: i.id)
def test_conformance_samples(item):
    outcome = run_with(item, "kda", chunked=wrapper.kda_chunked)
    assert outcome.passed, outcome.summary()


@pytest.mark.parametrize("C, K, V, precision", [(32, 40, 48, "ieee"), (64, 32, 16, "ieee"), (16, 128, 32, "ieee"),
                                                 (64, 16, 64, "tf32x3")])
def test_intra_chunk_matches_the_torch_phase1(C, K, V, precision, monkeypatch):
    rows, HV = 3 * C + 5, 2
    tensors = packed_phase1_inputs(rows, HV, K, V, seed=C + K + V, spike_every=9)
    index = torch.full((5, C), rows, dtype=torch.long)                    # pad: the zero row
    for s, (a, z) in enumerate([(0, C), (C, 2 * C), (2 * C, 3 * C), (3 * C, rows), (7, 12)]):
        index[s, : z - a] = torch.arange(a, z)                            # full, partial and short chunks
    nan_poisoned_empty(monkeypatch, intra)
    got = intra.intra_chunk(*tensors, index, precision=precision)
    monkeypatch.undo()
    want = blocked.intra_chunk_torch(*(x.double() for x in tensors), index)
    assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
    for name, g, w in zip(("W", "U", "A_qk", "qeG", "kdec", "eGC"), got, want):
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), name
        assert error_ratio(g, w) < 1e-5, (name, error_ratio(g, w))
    assert (got[2][..., ~torch.ones(C, C, dtype=torch.bool).tril()] == 0).all()   # A_qk: 0 above the diagonal


@pytest.mark.parametrize("C, K, V, precision", [(64, 32, 16, "tf32x3"), (48, 40, 32, "tf32x3"),
                                                 (32, 16, 48, "ieee"), (16, 32, 16, "tf32x3")])
def test_mma_intra_chunk_matches_the_torch_phase1_and_the_blocks_form(C, K, V, precision, monkeypatch):
    # the whole-chunk form on K3's gates: half the key channels near the -5 lower bound (e^-80 across
    # a 16-row block), half slow, spikes of -50; keys strongly correlated; full, partial and short chunks
    # (C = 48: the tiles padded to 64 rows); outputs NaN-poisoned
    rows, HV = 3 * C + 5, 2
    q, k, v, g, beta = packed_phase1_inputs(rows, HV, K, V, seed=C + K + V + 1, spike_every=9)
    gen = torch.Generator().manual_seed(C)
    g[:-1] = -5.0 * torch.sigmoid(2.0 + torch.randn(rows, HV, K, generator=gen))
    g[:-1, :, 1::2] *= 0.01
    g[5:-1:13] = -50.0
    k[:-1] = ref.l2_norm(k[:-1] + 2 * k[:1])
    index = torch.full((5, C), rows, dtype=torch.long)                    # pad: the zero row
    for s, (a, z) in enumerate([(0, C), (C, 2 * C), (2 * C, 3 * C), (3 * C, rows), (7, 12)]):
        index[s, : z - a] = torch.arange(a, z)
    nan_poisoned_empty(monkeypatch, intra)
    got = intra.intra_chunk(q, k, v, g, beta, index, form="mma", precision=precision)
    monkeypatch.undo()
    blocks = intra.intra_chunk(q, k, v, g, beta, index, form="blocks")
    want = blocked.intra_chunk_torch(*(x.double() for x in (q, k, v, g, beta)), index)
    for name, a, b, w in zip(("W", "U", "A_qk", "qeG", "kdec", "eGC"), got, blocks, want):
        assert a.shape == w.shape and a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert error_ratio(a, w) < 1e-5, (name, error_ratio(a, w))
        assert error_ratio(a, b) < 1e-5, (name, error_ratio(a, b))                 # the served form's outputs
    assert (got[2][..., ~torch.ones(C, C, dtype=torch.bool).tril()] == 0).all()   # A_qk: 0 above the diagonal


@pytest.mark.parametrize("neumann, form", [(True, "blocks"), (False, "blocks"), (True, "mma")])
def test_intra_chunk_solve_stays_accurate_with_correlated_keys(neumann, form):
    # keys all near one direction, beta 1 and slow decays: (I + L) is far from I, and the powers
    # of L in the product-form inverse cancel; with its Newton step it matches float64 as the
    # row-by-row inverse does (without the step W's error was ~1e-4 here)
    rows, HV, K, V, C = 128, 2, 64, 32, 64
    q, k, v, g, beta = packed_phase1_inputs(rows, HV, K, V, seed=11, decay=0.05, spike_every=9)
    k[:-1] = ref.l2_norm(k[:-1] + 3 * k[:1])
    g[:-1] = -0.05 * torch.rand(rows, HV, K, generator=torch.Generator().manual_seed(1))
    beta[:-1] = 1.0
    index = torch.arange(rows).view(2, C)
    got = intra.intra_chunk(q, k, v, g, beta, index, neumann=neumann, form=form)
    want = blocked.intra_chunk_torch(*(x.double() for x in (q, k, v, g, beta)), index)
    for name, a, b in zip(("W", "U"), got, want):
        assert error_ratio(a, b) < 2e-6, (name, error_ratio(a, b))


def test_intra_chunk_fallbacks_and_errors():
    tensors = packed_phase1_inputs(40, 2, 16, 16, seed=3, spike_every=9)
    index = torch.arange(32).view(2, 16)
    d = [x.double() for x in tensors]
    for g, w in zip(intra.intra_chunk(*d, index), blocked.intra_chunk_torch(*d, index)):   # float64: torch
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for g, w in zip(intra.intra_chunk(*d, index, form="mma"), blocked.intra_chunk_torch(*d, index)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    with pytest.raises(ValueError, match="precision"):
        intra.intra_chunk(*tensors, index, precision="tf32")
    with pytest.raises(ValueError, match="form"):
        intra.intra_chunk(*tensors, index, form="wgmma")
    with pytest.raises(ValueError, match="multiple of 16"):
        intra.intra_chunk(*tensors, torch.arange(24).view(1, 24), form="mma")


@pytest.mark.parametrize("form, dtype, chunk, group_elements", [   # group_elements 1: a group per chunk
    ("served", torch.float32, 32, None), ("served", torch.bfloat16, 64, None),
    ("mma", torch.float32, 64, None), ("mma", torch.bfloat16, 48, None), ("rows", torch.float32, 64, None),
    ("triton_diagonal", torch.float32, 64, 1), ("triton_diagonal", torch.bfloat16, 32, 1),
    ("triton_diagonal", torch.float32, 32, None)])
def test_ragged_checkpoints_match_the_reference(form, dtype, chunk, group_elements, monkeypatch):
    if group_elements is not None:
        monkeypatch.setattr(wrapper, "GROUP_ELEMENTS", group_elements)
    calls, decay = [], 1.0
    if form in ("served", "mma", "rows"):
        counted = lambda *a, **kw: calls.append((kw["form"], kw["diag_columns"])) or intra.intra_chunk(*a, **kw)  # noqa: E731
        monkeypatch.setattr(wrapper, "intra_chunk", counted)
        run = {"served": wrapper.kda_chunked, "mma": wrapper.kda_chunked_mma,       # rows: the diagonal decays as
               "rows": functools.partial(wrapper.kda_chunked, diag_columns=False)}[form]   # [16, 16, slice] tensors
        decay = 5.0 if form == "mma" else 1.0                             # K3's gate bound, spikes of -50 too
    else:
        counted = lambda *a, **kw: calls.append(1) or diag.diagonal_blocks(*a, **kw)   # noqa: E731
        monkeypatch.setattr(wrapper, "diagonal_blocks", counted)
        run = wrapper.kda_chunked_triton_diagonal
    args, kw = ragged_prefill_inputs([45, 100, 31], dtype=dtype, decay=decay)
    offsets = torch.tensor([[5, 45], [64, 70], [0, 31]])
    nan_poisoned_empty(monkeypatch, wrapper)                             # every torch.empty, for the call
    got = run(*args, **kw, chunk_size=chunk, checkpoint_offsets=offsets)
    monkeypatch.undo()
    want = float64_reference(args, kw, chunk, offsets)
    assert got.o.dtype == dtype and got.state.dtype == torch.float32 and len(got.checkpoints) == 2
    # the Triton phase 1 in one launch, or the Triton diagonal grouped as asked
    if form in ("served", "mma", "rows"):
        assert calls == [{"served": (wrapper.INTRA_FORM, None), "mma": ("mma", None), "rows": ("blocks", False)}[form]]
    else:
        assert calls and (group_elements is None or len(calls) > 3)
    assert_matches_reference(got, want, dtype)


def test_float64_and_a_cpu_without_the_interpreter_take_the_torch_diagonal(monkeypatch):
    args, kw = ragged_prefill_inputs([20, 30], dtype=torch.float64)
    assert not wrapper.uses_triton(*args, kw["initial_state"])
    f32 = [a.float() for a in args]
    assert wrapper.uses_triton(*f32, kw["initial_state"])
    assert not wrapper.uses_triton(*f32, kw["initial_state"].double())        # a float64 state: float64 compute
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not wrapper.uses_triton(*f32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = wrapper.kda_chunked(*args, **kw, chunk_size=32)
    want = blocked.kda_chunked(*args, **kw, chunk_size=32)
    for a, b in ((got.o, want.o), (got.state, want.state)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_groups_are_bounded_by_the_working_tensors():
    # K3's dimensions: the Triton diagonal's groups hold about twice the torch diagonal's chunks
    torch_group = blocked.GROUP_ELEMENTS // (96 * 64 * blocked.BLOCK * 128)
    triton_group = wrapper.GROUP_ELEMENTS // blocked.working_floats(96, 64, 128, 128)
    assert torch_group == 10 and triton_group == 22


rec = pytest.importorskip("k3.platforms.triton_kernels.kda_chunked_recurrence")
state = pytest.importorskip("k3.platforms.triton_kernels.kda_chunked_state")


@pytest.mark.parametrize("C, K, V, block_v, slice_, precision", [
    (32, 40, 48, 32, 16, "ieee"), (16, 16, 16, 32, 16, "ieee"), (48, 32, 64, 16, 32, "ieee"),
    (64, 128, 32, 32, 16, "ieee"),
    (32, 40, 48, 32, 16, "tf32x3"), (64, 128, 32, 32, 16, "tf32x3")])    # tf32x3: the state-in-registers kernel
def test_triton_recurrence_matches_the_torch_loop(C, K, V, block_v, slice_, precision, monkeypatch):
    counts = [3, 1, 0, 4, 2]                                              # an empty sequence too
    tensors, order, sizes = random_phase1_outputs(counts, 2, C, K, V, seed=C + K + V)
    capture = [0, 7, 3, 9]                                                # some chunk ends, in no order
    # outputs NaN-poisoned: unwritten memory shows
    nan_poisoned_empty(monkeypatch, rec)
    got = rec.recurrence(*tensors, order, sizes, capture, block_v=block_v, slice_=slice_, precision=precision)
    monkeypatch.undo()
    want = blocked.recurrence_torch(*tensors, order, sizes, capture)
    assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and torch.isfinite(g).all()
        assert error_ratio(g, w) < 1e-6, error_ratio(g, w)
    torch.testing.assert_close(got[1][2], tensors[-1][2], rtol=0, atol=0)   # no chunks: the initial state


def test_triton_recurrence_tables_and_fallbacks():
    table = rec.tables([1, 0, 2], [3, 2], capture=[4, 1], device="cpu")
    # round 0: segments 0, 1, 2 are the first chunks of 1, 0, 2; round 1: 3, 4 the second of 1, 0
    assert table[0].tolist() == [[1, 4], [0, 3], [2, -1]]
    assert table[1].tolist() == [[1, 0], [-1, -1], [-1, -1]]
    tensors, order, sizes = random_phase1_outputs([2, 1], 1, 16, 16, 16, seed=1)
    d = [t.double() for t in tensors]
    got = rec.recurrence(*d, order, sizes, [1])                          # float64: the torch loop
    for g, w in zip(got, blocked.recurrence_torch(*d, order, sizes, [1])):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    with pytest.raises(ValueError, match="block_v"):
        rec.recurrence(*tensors, order, sizes, block_v=24)
    with pytest.raises(ValueError, match="precision"):
        rec.recurrence(*tensors, order, sizes, precision="tf32")
    # the 3xTF32 launch option compiles and runs (the interpreter multiplies in fp32 either way;
    # its accuracy on tensor cores is the GPU benchmark's to show)
    got = rec.recurrence(*tensors, order, sizes, [1], precision="tf32x3")
    for g, w in zip(got, blocked.recurrence_torch(*tensors, order, sizes, [1])):
        assert error_ratio(g, w) < 1e-6, error_ratio(g, w)


@pytest.mark.parametrize("dtype, chunk", [(torch.float32, 32), (torch.float32, 64), (torch.bfloat16, 48)])
def test_the_wrapper_takes_the_triton_recurrence(dtype, chunk, monkeypatch):
    calls = []
    counted = lambda *a, **kw: calls.append(1) or rec.recurrence(*a, **kw)   # noqa: E731
    monkeypatch.setattr(wrapper, "recurrence", counted)
    args, kw = ragged_prefill_inputs([45, 100, 31, 0], dtype=dtype, vd=48)
    offsets = torch.tensor([[5, 45], [64, 96], [0, 31], [0, 0]])
    got = wrapper.kda_chunked(*args, **kw, chunk_size=chunk, checkpoint_offsets=offsets)
    want = float64_reference(args, kw, chunk, offsets)
    assert calls == [1]
    assert_matches_reference(got, want, dtype)


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("precision, dtype", [("ieee", torch.float32), ("tf32x3", torch.bfloat16)])
def test_triton_recurrence_writes_o_through_the_index(precision, dtype, split, monkeypatch):
    # o straight to the packed rows, by the fused recurrence and by the split one (state kernel,
    # then the output launch): the chunk positions go to the even rows of `out` in a shuffled
    # order, the last ones past its end (padding, dropped); the odd rows must stay as they were
    module = state if split else rec
    run = functools.partial(state.recurrence_split, block_v=32, out_block_v=32) if split else rec.recurrence
    C, K, V, HV = 32, 40, 48, 2
    counts = [3, 1, 0, 4, 2]
    tensors, order, sizes = random_phase1_outputs(counts, HV, C, K, V, seed=17)
    nseg = sum(sizes)
    index = 2 * torch.randperm(nseg * C, generator=torch.Generator().manual_seed(0)).view(nseg, C)
    n_out = 2 * nseg * C - 40                                             # 20 positions past the end
    out = torch.full((n_out, HV, V), float("nan"), dtype=dtype)
    capture = [0, 7, 3, 9]
    nan_poisoned_empty(monkeypatch, module)
    got, final, captured = run(*tensors, order, sizes, capture, precision=precision, out=out, out_index=index)
    monkeypatch.undo()
    want_o, want_final, want_captured = blocked.recurrence_torch(*(t.double() for t in tensors), order, sizes,
                                                                 capture)
    assert got is out and out.dtype == dtype
    rows = index.reshape(-1)
    keep = rows < n_out
    want_rows = want_o.permute(0, 2, 1, 3).reshape(-1, HV, V)[keep]      # [positions kept, HV, V]
    assert torch.isfinite(out[rows[keep]]).all()
    assert error_ratio(out[rows[keep]], want_rows) < (1e-6 if dtype == torch.float32 else 1e-2)
    written = torch.zeros(n_out, dtype=torch.bool)
    written[rows[keep]] = True
    assert out[~written].isnan().all() and (~written).sum() == n_out - keep.sum()
    for g, w in ((final, want_final), (captured, want_captured)):
        assert torch.isfinite(g).all() and error_ratio(g, w) < 1e-6, error_ratio(g, w)
    # float64 takes the torch loop and scatters the same way
    out64 = torch.full((n_out, HV, V), float("nan"), dtype=torch.float64)
    run(*(t.double() for t in tensors), order, sizes, capture, out=out64, out_index=index)
    torch.testing.assert_close(out64[rows[keep]], want_rows, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("intra_form, dtype, chunk", [("blocks", torch.bfloat16, 64), ("mma", torch.float32, 32)])
def test_o_through_the_index_matches_the_reference(intra_form, dtype, chunk, monkeypatch):
    # the wrapper with the recurrence writing o to the token rows itself (no scatter): ragged
    # sequences with chunk tails, an empty one, initial states, checkpoints, K3's gate bound with
    # spikes of -50; every torch.empty NaN-poisoned meanwhile (o's rows included)
    args, kw = ragged_prefill_inputs([45, 100, 0, 31], dtype=dtype, decay=5.0)
    offsets = torch.tensor([[5, 45], [64, 70], [0, 0], [0, 31]])
    want = float64_reference(args, kw, chunk, offsets)
    calls = []
    counted = lambda *a, **k: calls.append(k.get("out") is not None) or rec.recurrence(*a, **k)   # noqa: E731
    monkeypatch.setattr(wrapper, "recurrence", counted)
    nan_poisoned_empty(monkeypatch, blocked)
    got = wrapper.kda_chunked(*args, **kw, chunk_size=chunk, checkpoint_offsets=offsets, intra_form=intra_form,
                              o_through_index=True)
    monkeypatch.undo()
    assert calls == [True] and got.o.dtype == dtype and got.o.shape == want.o.shape
    assert_matches_reference(got, want, dtype)
