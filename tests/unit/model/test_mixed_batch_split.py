"""Mixed batches: one-token steps first (`ForwardMetadata.num_decodes`) run on the KDA layer's
decode path and the prefill chunks after them on its prefill path, with the model's outputs
unchanged; `split_decodes` cuts the metadata at that boundary."""

import dataclasses
import operator

import pytest
import torch

from k3.checkpoint.loader import load_model
from k3.model import contiguous_block_table
from k3.model.kda import KDAMixer
from k3.model.mla import MLAMixer
from k3.model.metadata import (CheckpointMetadata, ForwardMetadata, ForwardMode, SpecMetadata,
                               leading_one_token_steps)
from model_runs import PAGE_SIZE, teacher_forced


def _meta(lens, context=None, checkpoints=False):
    g = torch.Generator().manual_seed(0)
    pieces = [torch.randint(0, 50, (n,), generator=g).tolist() for n in lens]
    meta = ForwardMetadata.build(pieces, context_lens=context or [3] * len(lens), state_indices=[4, 1, 3, 0][:len(lens)],
                                 block_table=contiguous_block_table(5, 2)[[4, 1, 3, 0][:len(lens)]],
                                 page_size=PAGE_SIZE)
    if checkpoints:
        meta.checkpoints = CheckpointMetadata(torch.arange(len(lens) * 2).view(-1, 2),
                                              torch.arange(len(lens) * 2).view(-1, 2) + 10)
    return meta


def test_build_counts_the_leading_one_token_steps():
    assert leading_one_token_steps([1, 1, 5, 1]) == 2
    assert leading_one_token_steps([4, 1]) == 0 and leading_one_token_steps([1, 1]) == 2
    assert _meta([1, 1, 5, 3]).num_decodes == 2 and _meta([5, 1]).num_decodes == 0


def test_split_decodes_cuts_every_field_at_the_boundary():
    meta = _meta([1, 1, 5, 3], context=[7, 2, 0, 4], checkpoints=True)
    (head, decodes), (tail, rest) = meta.split_decodes()
    assert (head, tail) == (slice(0, 2), slice(2, None))
    assert decodes.max_q_len == 1 and decodes.num_decodes == 2 and rest.max_q_len == 5 and rest.num_decodes == 0
    assert torch.equal(decodes.input_ids, meta.input_ids[:2]) and torch.equal(rest.input_ids, meta.input_ids[2:])
    assert torch.equal(rest.positions, meta.positions[2:]) and torch.equal(rest.slot_mapping, meta.slot_mapping[2:])
    assert decodes.cu_seqlens.tolist() == [0, 1, 2] and rest.cu_seqlens.tolist() == [0, 5, 8]
    assert rest.cu_seqlens.dtype == torch.int32
    for name in ("context_lens", "state_indices", "block_table", "checkpoints.positions", "checkpoints.state_indices"):
        whole, head_part, tail_part = (operator.attrgetter(name)(m) for m in (meta, decodes, rest))
        assert torch.equal(head_part, whole[:2]) and torch.equal(tail_part, whole[2:]), name
    assert (meta.mode, decodes.mode, rest.mode) == (ForwardMode.MIXED, ForwardMode.DECODE, ForwardMode.PREFILL)
    assert decodes.logits_indices.numel() == 0 and rest.logits_indices.numel() == 0


@pytest.mark.parametrize("lens", [[5, 1], [1, 1], [4, 3]])
def test_split_decodes_refuses_batches_without_both_parts(lens):
    meta = _meta(lens)
    with pytest.raises(ValueError, match="split_decodes needs"):
        meta.split_decodes()


def test_split_decodes_refuses_verifying_batches():
    meta = _meta([1, 4])
    meta.spec = SpecMetadata(lens=torch.tensor([0, 3], dtype=torch.int32))
    assert meta.mode is ForwardMode.VERIFY
    with pytest.raises(ValueError, match="no verifying sequence"):
        meta.split_decodes()


def _spy(calls, name, fn, tokens):
    def wrapped(*args, **kwargs):
        calls.append((name, tokens(args)))
        return fn(*args, **kwargs)
    return wrapped


@pytest.mark.parametrize("preset", ["k3-tiny", "k3.1-pro-tiny"])
def test_a_mixed_batch_runs_decodes_on_the_decode_path(preset, tiny_checkpoint):
    """Prompts of 6 and 23 tokens in chunks of 5: the second call holds the first prompt's last
    token (first) beside the second prompt's chunk. Its KDA layers call decode_step on that one
    token and chunked on the chunk, its MLA layers (and K3.1 Pro's DSA indexer) decode and
    prefill (K3.1 Pro's sparse prefill in the absorbed form too), and every logit equals the
    one-pass forward."""
    model = load_model(tiny_checkpoint(preset), dtype=torch.float64, progress=False)
    calls = []
    for layer in (m for m in model.modules() if isinstance(m, (KDAMixer, MLAMixer))):
        kda, mla = layer.kernels.kda, layer.kernels.mla
        layer.kernels = dataclasses.replace(
            layer.kernels,
            kda=dataclasses.replace(kda, decode_step=_spy(calls, "kda.decode_step", kda.decode_step, lambda a: a[0].shape[0]),
                                    chunked=_spy(calls, "kda.chunked", kda.chunked, lambda a: a[0].shape[1])),
            mla=dataclasses.replace(mla, decode=_spy(calls, "mla.decode", mla.decode, lambda a: a[0].shape[0]),
                                    prefill=_spy(calls, "mla.prefill", mla.prefill, lambda a: a[0].shape[0])))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 384, (n,), generator=g).tolist() for n in (6, 23)]
    whole = teacher_forced(model, prompts)
    calls.clear()
    chunked = teacher_forced(model, prompts, chunk=5)
    layers = model.cfg.num_hidden_layers
    # call 1: chunks 5 + 5 (one chunked / prefill call per layer); call 2: token 6 of prompt 0 (a
    # decode) beside 5 tokens of prompt 1, split in every layer; calls 3-5: prompt 1 alone
    second = calls[layers: 3 * layers]
    pairs = list(zip(second[0::2], second[1::2]))
    # DSA (K3.1 Pro) attends in the absorbed form for prefill too: mla.decode over each query's selection
    sparse = model.cfg.uses_dsa
    kda_pair = (("kda.decode_step", 1), ("kda.chunked", 5))
    mla_pair = (("mla.decode", 1), ("mla.decode" if sparse else "mla.prefill", 5))
    assert len(second) == 2 * layers and all(p in (kda_pair, mla_pair) for p in pairs), second
    assert kda_pair in pairs and mla_pair in pairs
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-9)


def test_dsa_prefill_in_the_absorbed_form_equals_the_expanded_form():
    """The identity DSA's prefill now relies on: for every query's selection, the absorbed MQA
    over the paged latents (`mla_decode` with cu_seqlens_q) equals the expanded MHA over the
    same rows (`mla_prefill` with topk_indices), float64, ragged sequences, shuffled pages."""
    from k3 import reference as ref

    g = torch.Generator().manual_seed(3)
    h, dn, dr, dv, r, page = 4, 16, 8, 12, 32, 4
    q_lens, ctx_before, topk = [5, 3], [6, 0], 4
    kv_lens = [c + q for c, q in zip(ctx_before, q_lens)]
    rows = [torch.randn(n, r + dr, dtype=torch.float64, generator=g) for n in kv_lens]
    pages_each = -(-max(kv_lens) // page)
    perm = torch.randperm(2 * pages_each, generator=g)
    table = perm.view(2, pages_each).int()
    cache = torch.zeros(2 * pages_each, page, r + dr, dtype=torch.float64)
    for n, seq in enumerate(rows):
        for p in range(seq.shape[0]):
            cache[table[n, p // page], p % page] = seq[p]
    t = sum(q_lens)
    q = torch.randn(t, h, dn + dr, dtype=torch.float64, generator=g)
    kv_b = torch.randn(h * (dn + dv), r, dtype=torch.float64, generator=g)
    # each query selects topk positions of its causal prefix (all of them when it is shorter), -1 padded
    sel = []
    for n, (c, ql) in enumerate(zip(ctx_before, q_lens)):
        for i in range(ql):
            visible = torch.randperm(c + i + 1, generator=g)[:topk]
            sel.append(torch.cat([visible, torch.full((topk - visible.numel(),), -1)]))
    sel = torch.stack(sel).int()
    cu_q = torch.tensor([0, q_lens[0], t], dtype=torch.int32)
    cu_kv = torch.tensor([0, kv_lens[0], sum(kv_lens)], dtype=torch.int32)
    flat = torch.cat(rows)
    scale = (dn + dr) ** -0.5
    expanded = ref.mla_prefill(q, flat[:, :r], flat[:, r:], kv_b, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, scale=scale,
                               qk_nope_head_dim=dn, v_head_dim=dv, topk_indices=sel)
    w_uk, w_uv = ref.mla_absorb_weights(kv_b, num_heads=h, qk_nope_head_dim=dn, v_head_dim=dv)
    absorbed = ref.mla_decode(q[..., :dn], q[..., dn:], cache, table, torch.tensor(kv_lens), w_uk, w_uv, scale=scale,
                              cu_seqlens_q=cu_q, topk_indices=sel)
    torch.testing.assert_close(absorbed, expanded, rtol=0, atol=1e-12)
