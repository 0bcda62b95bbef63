"""Phase 2 of the chunked KDA prefill split in two launches (platforms/triton_kernels/
kda_chunked_state.py: the state kernel, then the output product), under the interpreter: against
the torch loop (`recurrence_torch`) in float64 with ragged sequences over several rounds (an empty
one among them), initial states, checkpoints in no order, padded rows and dimensions that are not
powers of two, every output NaN-poisoned so unwritten memory shows; and the whole wrapper (`kda_chunked_state_split`, `recurrence_form="split"`) against
k3.reference.kda_chunked. The interpreter walks all R columns of the segment table (the steps past
a sequence's chunks masked off), where the compiled kernel stops at the sequence's own count.
o stored through the chunk index is checked beside the fused recurrence's, in
test_triton_kda_chunked_blocked.py."""

import pytest
import torch

from k3.platforms.torch_kernels import kda_chunked_blocked as blocked
from kda_chunked_cases import (assert_matches_reference, error_ratio, float64_reference, nan_poisoned_empty,
                               ragged_prefill_inputs, random_phase1_outputs)

state = pytest.importorskip("k3.platforms.triton_kernels.kda_chunked_state")
wrapper = pytest.importorskip("k3.platforms.triton_kernels.kda_chunked_blocked")


def _close(got, want, ratio=1e-6, floor=1e-6):
    """got within `ratio` of want's norm, or `floor` absolute (float64 truth)."""
    err = (got.double() - want.double()).norm().item()
    assert err <= ratio * want.double().norm().item() + floor, (err, error_ratio(got, want))


@pytest.mark.parametrize("C, K, V, launch, precision", [
    (32, 40, 48, dict(block_v=32, out_block_v=16), "tf32x3"),            # K, V not powers of two; 2 + 3 V blocks
    (48, 16, 16, {}, "ieee"),                                            # C padded to 64 rows; V below the default block
    (16, 64, 32, dict(block_v=16, out_k_slice=16, num_stages=1, max_registers=168), "tf32x3")])
def test_split_recurrence_matches_the_torch_loop(C, K, V, launch, precision, monkeypatch):
    counts = [3, 1, 0, 4, 2]                                              # 4 rounds; an empty sequence too
    tensors, order, sizes = random_phase1_outputs(counts, 2, C, K, V, seed=C + K + V)
    capture = [0, 7, 3, 9]                                                # some chunk ends, in no order
    nan_poisoned_empty(monkeypatch, state)
    got = state.recurrence_split(*tensors, order, sizes, capture, precision=precision, **launch)
    monkeypatch.undo()
    want = blocked.recurrence_torch(*(t.double() for t in tensors), order, sizes, capture)
    assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
    for g, w in zip(got, want):                                           # o_chunks, final, captured
        assert g.dtype == torch.float32 and torch.isfinite(g).all()
        _close(g, w)
    torch.testing.assert_close(got[1][2], tensors[-1][2], rtol=0, atol=0)   # no chunks: the initial state


def test_split_recurrence_fallbacks_and_errors():
    tensors, order, sizes = random_phase1_outputs([2, 1], 1, 16, 16, 16, seed=1)
    d = [t.double() for t in tensors]
    got = state.recurrence_split(*d, order, sizes, [1])                  # float64: the torch loop
    for g, w in zip(got, blocked.recurrence_torch(*d, order, sizes, [1])):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    empty = [t[:, :0] for t in tensors[:-1]] + [tensors[-1][:, :0]]       # no heads: nothing to do
    assert all(x.numel() == 0 for x in state.recurrence_split(*empty, order, sizes))
    with pytest.raises(ValueError, match="block_v"):
        state.recurrence_split(*tensors, order, sizes, block_v=24)
    with pytest.raises(ValueError, match="out_k_slice"):
        state.recurrence_split(*tensors, order, sizes, out_k_slice=8)
    with pytest.raises(ValueError, match="precision"):
        state.recurrence_split(*tensors, order, sizes, precision="tf32")
    with pytest.raises(ValueError, match="sizes"):
        state.recurrence_split(*tensors, order, [2, 2])
    with pytest.raises(ValueError, match="together"):
        state.recurrence_split(*tensors, order, sizes, out=torch.zeros(4, 1, 16))


@pytest.mark.parametrize("entry, dtype, chunk, o_rows", [
    ("kda_chunked_state_split", torch.bfloat16, 64, None),               # o stored through the index (served)
    ("recurrence_form", torch.float32, 32, False)])                       # o_chunks, scattered after
def test_the_split_wrapper_matches_the_reference(entry, dtype, chunk, o_rows, monkeypatch):
    # ragged sequences with chunk tails, an empty one, initial states, checkpoints, K3's gate bound
    # with spikes of -50; the split recurrence called once; every torch.empty NaN-poisoned
    args, kw = ragged_prefill_inputs([45, 100, 0, 31], dtype=dtype, vd=48, decay=5.0)
    offsets = torch.tensor([[5, 45], [64, 70], [0, 0], [0, 31]])
    want = float64_reference(args, kw, chunk, offsets)
    calls = []
    counted = lambda *a, **k: calls.append(k.get("out") is not None) or state.recurrence_split(*a, **k)   # noqa: E731
    monkeypatch.setattr(wrapper, "recurrence_split", counted)
    monkeypatch.setattr(wrapper, "recurrence", None)                      # the fused kernel is not taken
    nan_poisoned_empty(monkeypatch, blocked)
    if entry == "kda_chunked_state_split":
        got = wrapper.kda_chunked_state_split(*args, **kw, chunk_size=chunk, checkpoint_offsets=offsets)
    else:
        got = wrapper.kda_chunked(*args, **kw, chunk_size=chunk, checkpoint_offsets=offsets, recurrence_form="split",
                                  o_through_index=o_rows)
    monkeypatch.undo()
    assert calls == [wrapper.O_THROUGH_INDEX if o_rows is None else o_rows]
    assert got.o.dtype == dtype and got.o.shape == want.o.shape and len(got.checkpoints) == 2
    assert_matches_reference(got, want, dtype)
    with pytest.raises(ValueError, match="recurrence_form"):
        wrapper.kda_chunked(*args, **kw, chunk_size=chunk, recurrence_form="fast")
