"""Phase 1 of the chunked KDA prefill in its "split" form (platforms/triton_kernels/kda_intra_split.py:
three launches with wide grids), under the interpreter: against the torch phase 1 in float64
(K3's gates with spikes of -50, strongly correlated keys, full, partial and padded chunks,
dimensions that are not powers of two, outputs NaN-poisoned so unwritten memory shows), through
`intra_chunk(form="split")`, and the whole prefill (`kda_chunked_split`) on ragged sequences with
initial states and checkpoints against k3.reference.kda_chunked. Tiny shapes: the interpreter's
time is CI's."""

import pytest
import torch

from k3 import reference as ref
from k3.platforms.torch_kernels import kda_chunked_blocked as blocked
from kda_chunked_cases import (assert_matches_reference, error_ratio, float64_reference, nan_poisoned_empty,
                               packed_phase1_inputs, ragged_prefill_inputs)

split = pytest.importorskip("k3.platforms.triton_kernels.kda_intra_split")
intra = pytest.importorskip("k3.platforms.triton_kernels.kda_intra_chunk")
wrapper = pytest.importorskip("k3.platforms.triton_kernels.kda_chunked_blocked")
rec = pytest.importorskip("k3.platforms.triton_kernels.kda_chunked_recurrence")

NAMES = ("W", "U", "A_qk", "qeG", "kdec", "eGC")


def _index(C, rows, spans):
    """[len(spans), C] chunk positions' rows, the tails padded with the zero row `rows`."""
    index = torch.full((len(spans), C), rows, dtype=torch.long)
    for s, (a, z) in enumerate(spans):
        index[s, : z - a] = torch.arange(a, z)
    return index


def _check(got, want, C, bound=1e-5):
    assert [tuple(a.shape) for a in got] == [tuple(w.shape) for w in want]
    for name, a, w in zip(NAMES, got, want):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert error_ratio(a, w) < bound, (name, error_ratio(a, w))
    assert (got[2][..., ~torch.ones(C, C, dtype=torch.bool).tril()] == 0).all()   # A_qk: 0 above the diagonal


@pytest.mark.parametrize("C, K, V, launch", [
    (32, 40, 48, dict(precision="ieee")),                                 # C = 32: launch 2's one row
    (64, 32, 16, dict()),                                                 # the defaults (tf32x3 wide dots)
    (48, 24, 40, dict(precision="ieee", solve_precision="tf32x3", slice_=32, w_slice=16)),   # tiles padded
    (16, 16, 32, dict(neumann=False)),                                    # one block: no launch 2
    (32, 40, 24, dict(diag_columns=True))])                               # the diagonal block a column at a time
def test_split_matches_the_torch_phase1(C, K, V, launch, monkeypatch):
    # K3's gates: half the key channels near the -5 lower bound (e^-80 across a 16-row block), half
    # slow, spikes of -50; full, partial and short chunks (padded with the zero row); NaN-poisoned outputs
    rows, HV = 3 * C + 5, 2
    q, k, v, g, beta = packed_phase1_inputs(rows, HV, K, V, seed=C + K + V)
    gen = torch.Generator().manual_seed(C)
    g[:-1] = -5.0 * torch.sigmoid(2.0 + torch.randn(rows, HV, K, generator=gen))
    g[:-1, :, 1::2] *= 0.01
    g[5:-1:13] = -50.0
    index = _index(C, rows, [(0, C), (C, 2 * C), (2 * C, 3 * C), (3 * C, rows), (7, 12)])
    nan_poisoned_empty(monkeypatch, split)
    got = split.intra_chunk_split(q, k, v, g, beta, index, **launch)
    monkeypatch.undo()
    want = blocked.intra_chunk_torch(*(x.double() for x in (q, k, v, g, beta)), index)
    _check(got, want, C)


@pytest.mark.parametrize("form", ["blocks", "mma"])
def test_one_launch_forms_with_the_diagonal_by_columns_match_the_torch_phase1(form, monkeypatch):
    # `_diagonal_block_by_columns` in the one-launch forms: K3's gates with spikes, padded chunks
    C, K, V, HV = 32, 40, 24, 2
    rows = 2 * C + 7
    q, k, v, g, beta = packed_phase1_inputs(rows, HV, K, V, seed=29)
    index = _index(C, rows, [(0, C), (C, 2 * C), (2 * C, rows)])
    nan_poisoned_empty(monkeypatch, intra)
    got = intra.intra_chunk(q, k, v, g, beta, index, form=form, diag_columns=True)
    monkeypatch.undo()
    _check(got, blocked.intra_chunk_torch(*(x.double() for x in (q, k, v, g, beta)), index), C)


def test_split_strong_decays_every_seventh_step_and_chunks_out_of_order():
    # uniform gates in [-1, 0] with every 7th row -50; chunks that start anywhere, overlap and
    # come in no order (phase 1 treats each chunk on its own)
    C, K, V, HV, rows = 32, 20, 24, 3, 70
    tensors = packed_phase1_inputs(rows, HV, K, V, seed=4)
    index = _index(C, rows, [(38, 70), (3, 35), (0, 9), (50, 70)])
    got = split.intra_chunk_split(*tensors, index)
    want = blocked.intra_chunk_torch(*(x.double() for x in tensors), index)
    _check(got, want, C)


@pytest.mark.parametrize("neumann", [True, False])
def test_split_solve_stays_accurate_with_correlated_keys(neumann):
    # keys all near one direction, beta 1 and slow decays: (I + L) is far from I (the explicit T
    # and the product-form inverse of its diagonal blocks must not lose W's digits)
    rows, HV, K, V, C = 128, 2, 64, 32, 64
    q, k, v, g, beta = packed_phase1_inputs(rows, HV, K, V, seed=11, decay=0.05)
    k[:-1] = ref.l2_norm(k[:-1] + 3 * k[:1])
    g[:-1] = -0.05 * torch.rand(rows, HV, K, generator=torch.Generator().manual_seed(1))
    beta[:-1] = 1.0
    index = torch.arange(rows).view(2, C)
    got = split.intra_chunk_split(q, k, v, g, beta, index, neumann=neumann, precision="ieee")
    want = blocked.intra_chunk_torch(*(x.double() for x in (q, k, v, g, beta)), index)
    for name, a, b in zip(("W", "U"), got, want):
        assert error_ratio(a, b) < 2e-6, (name, error_ratio(a, b))


def test_intra_chunk_form_split_dispatches_and_the_fallbacks():
    tensors = packed_phase1_inputs(40, 2, 16, 16, seed=3)
    index = torch.arange(32).view(2, 16)
    for a, b in zip(intra.intra_chunk(*tensors, index, form="split", precision="ieee"),
                    split.intra_chunk_split(*tensors, index, precision="ieee")):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert intra.PRECISION["split"] == split.PRECISION == "tf32x3"
    d = [x.double() for x in tensors]
    for a, b in zip(intra.intra_chunk(*d, index, form="split"), blocked.intra_chunk_torch(*d, index)):
        assert a.dtype == torch.float64                                   # float64: the torch phase 1
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="precision"):
        intra.intra_chunk(*tensors, index, form="split", precision="tf32")
    with pytest.raises(ValueError, match="solve_precision"):
        split.intra_chunk_split(*tensors, index, solve_precision="bf16")
    with pytest.raises(ValueError, match="multiple of 16"):
        split.intra_chunk_split(*tensors, torch.arange(24).view(1, 24))


@pytest.mark.parametrize("dtype, chunk, o_through_index", [(torch.float32, 32, True), (torch.bfloat16, 48, False)])
def test_kda_chunked_split_matches_the_reference(dtype, chunk, o_through_index, monkeypatch):
    # the whole prefill with phase 1 split: ragged sequences with chunk tails, an empty one,
    # initial states, checkpoints (chunks cut at them), K3's gate bound with spikes of -50; every
    # torch.empty NaN-poisoned meanwhile; o stored by the recurrence or scattered after it
    args, kw = ragged_prefill_inputs([45, 70, 0, 31], dtype=dtype, decay=5.0)
    offsets = torch.tensor([[5, 45], [64, 40], [0, 0], [0, 31]])
    want = float64_reference(args, kw, chunk, offsets)
    calls = []
    counted = lambda *a, **k: calls.append(k["form"]) or intra.intra_chunk(*a, **k)   # noqa: E731
    monkeypatch.setattr(wrapper, "intra_chunk", counted)
    monkeypatch.setattr(wrapper, "O_THROUGH_INDEX", o_through_index)
    nan_poisoned_empty(monkeypatch, blocked)
    got = wrapper.kda_chunked_split(*args, **kw, chunk_size=chunk, checkpoint_offsets=offsets)
    monkeypatch.undo()
    assert calls == ["split"] and got.o.dtype == dtype and got.o.shape == want.o.shape and len(got.checkpoints) == 2
    assert_matches_reference(got, want, dtype)
