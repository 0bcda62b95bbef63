"""KDA checkpoints are emitted inside the prefill pass: the state rows they fill equal the
state reached by prefilling only that prefix (recurrent and conv), in the same forward."""

import pytest
import torch

from k3.cache.pool import CachePool
from k3.checkpoint.loader import load_model
from k3.model import contiguous_block_table
from k3.model.metadata import CheckpointMetadata, ForwardMetadata

PAGE = 16
ROWS = 8                    # state rows 0..7, then 32 pages


def _cache(model):
    return CachePool.for_model(model, ROWS + 32, block_size=PAGE).views


def _prefill(model, cache, prompts, rows, *, context=None, ckpt_pos=None, ckpt_rows=None):
    table = contiguous_block_table(8, 4) + ROWS                      # pages after the 8 state rows
    meta = ForwardMetadata.build(prompts, context_lens=context or [0] * len(prompts), state_indices=rows,
                                 block_table=table[rows], page_size=PAGE)
    if ckpt_pos is not None:
        meta.checkpoints = CheckpointMetadata(torch.tensor(ckpt_pos), torch.tensor(ckpt_rows))
    return model(meta, cache)


@pytest.mark.parametrize("preset", ["k3-tiny", "kimi-linear-tiny"])
def test_checkpoints_equal_prefix_states(preset, tiny_checkpoint):
    model = load_model(tiny_checkpoint(preset), dtype=torch.float64, progress=False)
    cache = _cache(model)
    a = [(3 * i) % 300 + 1 for i in range(37)]
    b = [(5 * i) % 300 + 1 for i in range(20)]
    # checkpoints for a at 16 and 32, for b at 7 (-1: none); written to rows 4, 5, 6
    _prefill(model, cache, [a, b], [0, 1], ckpt_pos=[[16, 32], [7, -1]], ckpt_rows=[[4, 5], [6, 7]])
    expected = _cache(model)
    _prefill(model, expected, [a[:16], a[:32], b[:7]], [0, 1, 2])
    for layer in range(len(model.cfg.kda_layer_ids)):
        got, ref = cache.kda[layer], expected.kda[layer]
        for row, ref_row in ((4, 0), (5, 1), (6, 2)):
            torch.testing.assert_close(got.recurrent[row], ref.recurrent[ref_row], rtol=0, atol=1e-12)
            torch.testing.assert_close(got.conv[row], ref.conv[ref_row], rtol=0, atol=1e-12)
        assert torch.isnan(got.recurrent[7]).all()                # -1: nothing written


def test_checkpoint_in_a_later_chunk(tiny_checkpoint):
    """Only checkpoints inside the current chunk are written (context_len <= p <= end)."""
    model = load_model(tiny_checkpoint("k3-tiny"), dtype=torch.float64, progress=False)
    cache = _cache(model)
    a = [(3 * i) % 300 + 1 for i in range(40)]
    _prefill(model, cache, [a[:20]], [0], ckpt_pos=[[32]], ckpt_rows=[[3]])
    assert torch.isnan(cache.kda[0].recurrent[3]).all()
    _prefill(model, cache, [a[20:]], [0], context=[20], ckpt_pos=[[32]], ckpt_rows=[[3]])
    expected = _cache(model)
    _prefill(model, expected, [a[:32]], [0])
    torch.testing.assert_close(cache.kda[0].recurrent[3], expected.kda[0].recurrent[0], rtol=0, atol=1e-12)
