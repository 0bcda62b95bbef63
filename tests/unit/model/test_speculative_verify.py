"""Verify steps leave the running KDA state untouched and keep what the commit needs: the
per-token states ("states") or records ("recover"); either commit equals sequential decoding."""

import copy

import pytest
import torch

from k3.cache.pool import CachePool
from k3.checkpoint.loader import load_model
from k3.model import contiguous_block_table
from k3.model.metadata import ForwardMetadata, SpecMetadata

PAGE = 16


def _meta(tokens, context, rows, table):
    return ForwardMetadata.build(tokens, context_lens=context, state_indices=rows, block_table=table[rows],
                                 page_size=PAGE, all_logits=True)


@pytest.mark.parametrize("host_positions", [False, True], ids=["positions_from_spec_lens", "positions_from_engine"])
@pytest.mark.parametrize("mode", ["states", "recover"])
def test_verify_then_commit_equals_sequential(mode, host_positions, tiny_checkpoint):
    model = load_model(tiny_checkpoint("k3.1-pro-tiny"), dtype=torch.float64, progress=False)
    table = contiguous_block_table(12, 4) + 12                          # pages after the 12 state rows
    prompt_a, prompt_b = [(3 * i) % 300 + 1 for i in range(21)], [(5 * i) % 300 + 2 for i in range(9)]
    drafts = [17, 4, 99, 250]                           # a's verify: its last token + 4 drafts
    pool = CachePool.for_model(model, 12 + 48, block_size=PAGE)
    cache = pool.views
    model(_meta([prompt_a[:-1], prompt_b[:-1]], [0, 0], [0, 1], table), cache)
    sequential = copy.deepcopy(cache)

    # reference: a decodes its last token and the drafts one by one; b decodes its last token
    seq_logits, seq_states = [], []
    tokens = [prompt_a[-1]] + drafts
    for j, tok in enumerate(tokens):
        step = [[tok], [prompt_b[-1]]] if j == 0 else [[tok]]
        rows = [0, 1] if j == 0 else [0]
        ctx = [20 + j, 8] if j == 0 else [20 + j]
        seq_logits.append(model(_meta(step, ctx, rows, table), sequential).logits[0])
        seq_states.append(copy.deepcopy([(v.recurrent[0].clone(), v.conv[0].clone()) for v in sequential.kda]))

    # verify: a brings 1 + 4 tokens (speculating), b one token (not speculating), one forward
    meta = _meta([tokens, [prompt_b[-1]]], [20, 8], [0, 1], table)
    spec = SpecMetadata(lens=torch.tensor([4, 0], dtype=torch.int32))
    if host_positions:                                  # as the engine's runner builds them
        spec.positions = torch.tensor([[0, j] for j in range(5)])
    if mode == "states":
        spec.state_indices = torch.tensor([[4, 5, 6, 7, 8], [1, 1, 1, 1, 1]])
    else:
        pool.allocate_records(slots=2, tokens=5)
        spec.record_slots = torch.tensor([1, 0])
    meta.spec = spec
    before = [v.recurrent[0].clone() for v in cache.kda]
    logits = model(meta, cache).logits
    torch.testing.assert_close(logits[:5], torch.stack(seq_logits), rtol=0, atol=1e-9)
    for v, b in zip(cache.kda, before):
        assert torch.equal(v.recurrent[0], b)                      # running row untouched
    torch.testing.assert_close(cache.kda[0].recurrent[1], sequential.kda[0].recurrent[1], rtol=0, atol=1e-10)

    for kept in (1, 3, 5):                                        # accepted = kept - 1 drafts
        trial = copy.deepcopy(cache)
        if mode == "states":
            for v in trial.kda:
                v.recurrent[0] = v.recurrent[3 + kept]
                v.conv[0] = v.conv[3 + kept]
        else:
            model.commit_speculation(trial, torch.tensor([1]), torch.tensor([0]), torch.tensor([kept]))
        for layer, v in enumerate(trial.kda):
            rec, conv = seq_states[kept - 1][layer]
            torch.testing.assert_close(v.recurrent[0], rec, rtol=0, atol=1e-10)
            torch.testing.assert_close(v.conv[0], conv, rtol=0, atol=1e-12)


@pytest.mark.parametrize("host_positions", [False, True], ids=["positions_from_spec_lens", "positions_from_engine"])
def test_recover_mode_refuses_more_verified_tokens_than_record_slots(host_positions, tiny_checkpoint):
    model = load_model(tiny_checkpoint("k3.1-pro-tiny"), dtype=torch.float64, progress=False)
    table = contiguous_block_table(4, 4) + 4                            # pages after the 4 state rows
    pool = CachePool.for_model(model, 4 + 16, block_size=PAGE)
    cache = pool.views
    model(_meta([[5, 6, 7]], [0], [0], table), cache)
    pool.allocate_records(slots=1, tokens=3)
    meta = _meta([[8, 9, 10, 11, 12]], [3], [0], table)                  # 1 + 4 drafts into 3-token records
    meta.spec = SpecMetadata(lens=torch.tensor([4], dtype=torch.int32), record_slots=torch.tensor([0]),
                             positions=torch.tensor([[0, j] for j in range(5)]) if host_positions else None)
    with pytest.raises(ValueError, match="5 verified tokens exceed the record slots' 3"):
        model(meta, cache)
