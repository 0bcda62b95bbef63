"""The batch-invariant kernel set (`k3.platforms.torch_kernels.invariant`): every kernel case
passes on it against the float64 oracles, and each entry gives a row the same bits alone, among
other rows, in any chunking, and in its decode and prefill forms."""

from __future__ import annotations

import torch

from k3.conformance.registry import KERNEL_FAMILIES, items
from k3.conformance.runner import RunContext, run_item
from k3.platform import select_platform
from k3.platforms.torch_kernels.invariant import invariant_tables
from k3.quant.mxfp4 import MXFP4Tensor

K = invariant_tables()


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _randn(seed, *shape, scale=1.0):
    return torch.randn(*shape, generator=_g(seed)) * scale


def test_every_kernel_case_passes_on_the_invariant_kernels():
    ctx = RunContext(select_platform("reference", batch_invariant=True))
    outcomes = [(i, run_item(ctx, i)) for i in items("smoke", KERNEL_FAMILIES)]
    failed = [(i.case.name, i.sample.shape, o.summary()) for i, o in outcomes if not o.passed]
    assert not failed, failed


def _kda_inputs(seed, t, h=2, k=16, v=16):
    q, kk = (torch.nn.functional.normalize(_randn(seed + i, 1, t, h, k), dim=-1) for i in (0, 1))
    return q, kk, _randn(seed + 2, 1, t, h, v), -torch.rand(1, t, h, k, generator=_g(seed + 3)), \
        torch.rand(1, t, h, generator=_g(seed + 4))


def test_kda_a_sequence_gets_the_same_bits_alone_packed_chunked_and_decoded():
    t = 11
    mine = _kda_inputs(0, t)
    s0 = _randn(9, 1, 2, 16, 16, scale=0.1)
    alone = K["kda"].chunked(*mine, initial_state=s0, checkpoint_offsets=[4, t])
    # packed between two other sequences
    others = [_kda_inputs(20, 5), _kda_inputs(30, 7)]
    packed = [torch.cat([a, m, b], 1) for a, m, b in zip(others[0], mine, others[1])]
    states = torch.cat([_randn(10, 1, 2, 16, 16), s0, _randn(11, 1, 2, 16, 16)])
    out = K["kda"].chunked(*packed, initial_state=states, cu_seqlens=torch.tensor([0, 5, 5 + t, 12 + t]))
    assert torch.equal(out.o[:, 5: 5 + t], alone.o) and torch.equal(out.state[1], alone.state[0])
    # chunks of 3, 1 and 7 tokens, the state carried
    state, pieces = s0, []
    for lo, hi in ((0, 3), (3, 4), (4, t)):
        part = K["kda"].chunked(*(x[:, lo:hi] for x in mine), initial_state=state)
        pieces.append(part.o)
        state = part.state
        if hi == 4:
            assert torch.equal(state, alone.checkpoints[0])
    assert torch.equal(torch.cat(pieces, 1), alone.o) and torch.equal(state, alone.checkpoints[1])
    # decode form: B = N one-token sequences beside another one, token by token
    state = s0
    for i in range(t):
        step = [torch.cat([x[:, i: i + 1], y[:, :1]]) for x, y in zip(mine, others[0])]
        dec = K["kda"].recurrent(*step, initial_state=torch.cat([state, states[:1]]))
        assert torch.equal(dec.o[0, 0], alone.o[0, i])
        state = dec.state[:1]
    assert torch.equal(state, alone.state)


def test_kda_decode_step_is_the_unfused_path_of_the_same_entries():
    n, h, k = 3, 2, 16
    qkv, f, b, gate = _randn(1, n, 3 * h * k), _randn(2, n, h, k), _randn(3, n, h), _randn(4, n, h, k)
    conv_w, a_log, dt_bias, o_norm = _randn(5, 3 * h * k, 4, scale=0.5), _randn(6, h), _randn(7, h, k), _randn(8, k)
    rec, conv = _randn(9, 5, h, k, k, scale=0.1), _randn(10, 5, 3 * h * k, 3)
    rows, fresh = torch.tensor([4, 0, 2]), torch.tensor([False, True, False])
    rec2, conv2 = rec.clone(), conv.clone()
    got = K["kda"].decode_step(qkv, conv_w, f, a_log, dt_bias, b, gate, o_norm, rec, conv, rows, fresh,
                               lower_bound=-5.0, norm_eps=1e-5)
    e = invariant_tables()["elementwise"]
    conv_in = conv2[rows].masked_fill(fresh[:, None, None], 0)
    y = K["kda"].short_conv(qkv[None], conv_w, conv_state=conv_in, cu_seqlens=torch.arange(n + 1))
    q, kk, v = y.y[0].reshape(n, 3, h, k).unbind(1)
    g = K["kda"].gate(f, a_log, dt_bias, lower_bound=-5.0)
    s0 = rec2[rows].masked_fill(fresh[:, None, None, None], 0)
    out = K["kda"].chunked(e.l2_norm(q)[None], e.l2_norm(kk)[None], v[None], g[None], e.sigmoid(b)[None],
                           initial_state=s0, cu_seqlens=torch.arange(n + 1))
    assert torch.equal(got, e.gated_rms_norm(out.o[0], gate, o_norm, 1e-5))
    assert torch.equal(rec[rows], out.state) and torch.equal(conv[rows], y.state)


def _mla_setup(seed, length, page=16, h=2, dn=8, dr=4, r=16, dv=8):
    pages = -(-length // page)
    cache = _randn(seed, pages + 3, page, r + dr)
    table = torch.randperm(pages + 3, generator=_g(seed))[:pages][None]
    rows = cache[table[0]].reshape(-1, r + dr)[:length]
    kv_b = _randn(seed + 1, h * (dn + dv), r, scale=r ** -0.5)
    q = _randn(seed + 2, length, h, dn + dr)
    return cache, table, rows, kv_b, q


def test_mla_a_query_gets_the_same_bits_in_prefill_and_in_decode():
    from k3 import reference as ref

    length, dn, r = 70, 8, 16                                 # past one key block of 64
    cache, table, rows, kv_b, q = _mla_setup(0, length)
    w_uk, w_uv = ref.mla_absorb_weights(kv_b, num_heads=2, qk_nope_head_dim=dn, v_head_dim=8)
    cu = torch.tensor([0, length])
    sel = torch.stack([torch.randperm(length, generator=_g(i))[:20] for i in range(length)])
    sel[:, 0] = torch.arange(length)                          # DSA's causal top-k holds the query's own position
    sel = torch.where(sel <= torch.arange(length)[:, None], sel, -1).to(torch.int32)
    for topk in (None, sel):
        pre = K["mla"].prefill(q, rows[:, :r], rows[:, r:], kv_b, cu_seqlens_q=cu, cu_seqlens_kv=cu, scale=0.3,
                               qk_nope_head_dim=dn, v_head_dim=8, topk_indices=topk)
        other_cache, other_table, _, _, other_q = _mla_setup(5, 9)
        for i in (0, 31, 63, 64, 69):
            # decode of position i, with a companion sequence (its pages copied into the same cache)
            both = torch.cat([cache, other_cache])
            tables = torch.cat([table, torch.nn.functional.pad(other_table + cache.shape[0], (0, table.shape[1] - 1))])
            pick = None if topk is None else torch.cat([topk[i: i + 1], torch.full((1, 20), -1, dtype=torch.int32)])
            queries = torch.cat([q[i: i + 1], other_q[:1]])
            dec = K["mla"].decode(queries[:, :, :dn], queries[:, :, dn:], both, tables, torch.tensor([i + 1, 9]),
                                  w_uk, w_uv, scale=0.3, topk_indices=pick)
            assert torch.equal(dec[0], pre[i]), i
        # the whole prompt as cu_seqlens_q queries of the decode entry (the mode's prefill form)
        packed = K["mla"].decode(q[:, :, :dn], q[:, :, dn:], cache, table, torch.tensor([length]), w_uk, w_uv,
                                 scale=0.3, cu_seqlens_q=cu, topk_indices=topk)
        assert torch.equal(packed, pre)


def test_indexer_scores_are_the_same_bits_in_prefill_decode_and_paged_forms():
    from k3 import reference as ref

    length, page, hi, d = 40, 8, 4, 32
    keys = ref.indexer_quantize_keys(_randn(0, length, d), fmt="fp8")
    dense = ref.indexer_dequantize_keys(keys.values, keys.scales, fmt="fp8")
    q, w = _randn(1, length, hi, d), _randn(2, length, hi)
    cu = torch.tensor([0, length])
    pre = K["indexer"].scores(q, w, dense, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    values = keys.values.view(length // page, page, d)
    scales = keys.scales.view(length // page, page)
    table = torch.arange(length // page)[None]
    for i in (0, 17, 39):
        dec = K["indexer"].decode_scores(q[i: i + 1], w[i: i + 1], dense[None], torch.tensor([i + 1]))
        paged = K["indexer"].paged_decode_scores(q[i: i + 1], w[i: i + 1], values, scales, table,
                                                 torch.tensor([i + 1]), fmt="fp8")
        assert torch.equal(dec[0, : i + 1], pre[i, : i + 1]) and torch.equal(paged[0, : i + 1], pre[i, : i + 1])


def _rows_agree(fn, batch: list, row_args, at: int, *, dim=0):
    """fn on the batch, row `at` of its output, equals fn on that row alone."""
    whole = fn(*batch)
    alone = fn(*row_args)
    return torch.equal(whole.select(dim, at), alone.select(dim, 0))


def test_experts_and_lora_give_a_token_the_same_bits_alone_and_in_a_batch():
    t, e, l, i = 9, 8, 32, 16
    w13 = MXFP4Tensor(torch.randint(0, 256, (e, 2 * i, l // 2), generator=_g(0), dtype=torch.uint8),
                      torch.full((e, 2 * i, l // 32), 126, dtype=torch.uint8))
    w2 = _randn(1, e, l, i, scale=i ** -0.5)
    x, ids = _randn(2, t, l), torch.stack([torch.randperm(e, generator=_g(j))[:2] for j in range(t)])
    weights = torch.rand(t, 2, generator=_g(3))
    kw = dict(activation="situ", beta=4.0, linear_beta=25.0)
    for dense in (False, True):
        whole = K["moe"].experts(x, w13, w2, weights, ids, dense_dispatch=dense, **kw)
        for at in (0, 4, 8):
            alone = K["moe"].experts(x[at: at + 1], w13, w2, weights[at: at + 1], ids[at: at + 1], **kw)
            assert torch.equal(whole[at], alone[0]), (dense, at)
    a, b = _randn(4, 3, 4, l), _randn(5, 3, 64, 4)
    slots, scales = torch.tensor([0, -1, 2, 1, 0, 2, -1, 1, 0]), torch.tensor([0.5, 1.0, 2.0])
    whole = K["lora"].delta(x, a, b, scales, slots)
    assert all(torch.equal(whole[j], K["lora"].delta(x[j: j + 1], a, b, scales, slots[j: j + 1])[0]) for j in range(t))
    assert torch.equal(whole[1], torch.zeros(64))


def test_select_experts_breaks_ties_to_the_lower_expert_in_any_batch():
    logits = torch.zeros(3, 8)
    logits[1] = _randn(0, 8)
    sel = K["moe"].select_experts(logits, top_k=3, correction_bias=torch.zeros(8))
    assert sel.ids[0].tolist() == [0, 1, 2] and sel.ids[2].tolist() == [0, 1, 2]
    alone = K["moe"].select_experts(logits[1:2], top_k=3, correction_bias=torch.zeros(8))
    assert torch.equal(alone.ids[0], sel.ids[1]) and torch.equal(alone.weights[0], sel.weights[1])


def test_row_wise_entries_give_a_row_the_same_bits_alone_and_in_a_batch():
    el, at = invariant_tables()["elementwise"], 5
    x, gate, w = _randn(0, 37, 4, 16), _randn(1, 37, 4, 16), _randn(2, 16)
    checks = {
        "rms_norm": lambda z: el.rms_norm(z, w, 1e-5),
        "gated_rms_norm": lambda z: el.gated_rms_norm(z, gate[: z.shape[0]] if z.shape[0] > 1 else gate[at: at + 1],
                                                      w, 1e-5),
        "layer_norm": lambda z: el.layer_norm(z, w, w, 1e-6),
        "l2_norm": el.l2_norm,
        "glu_activation": lambda z: el.glu_activation(z.reshape(z.shape[0], -1), activation="situ", beta=4.0,
                                                      linear_beta=25.0),
        "sigmoid": el.sigmoid,
        "router_logits": lambda z: K["moe"].router_logits(z.reshape(z.shape[0], -1), _randn(3, 8, 64)),
        "attn_res_mix": lambda z: K["attn_res"].mix(torch.stack([z.reshape(z.shape[0], -1)] * 3) * torch.tensor(
            [1.0, -0.5, 2.0])[:, None, None], _randn(4, 64), eps=1e-5),
    }
    for name, fn in checks.items():
        assert _rows_agree(fn, [x], [x[at: at + 1]], at), name
