"""MLA: absorbed paged decode == expanded prefill; context, chunks, fp8, bf16, sparse. Decode is
checked on both implementations: the naive oracle (k3.reference) and the torch kernel the
reference platform serves (k3.platforms.torch_kernels)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from k3 import reference as ref
from k3.platforms.torch_kernels import mla_decode as torch_decode
from k3.quant.fp8 import fp8_dequantize, fp8_quantize
from k3.reference.mla import mla_absorb_weights, mla_expand_kv, mla_prefill

H, DN, DR, DV, R = 4, 16, 8, 12, 32
SCALE = 1.0 / math.sqrt(DN + DR)
F64 = torch.float64
IMPLS = {"reference": SimpleNamespace(mla_decode=ref.mla_decode), "torch": SimpleNamespace(mla_decode=torch_decode.mla_decode)}


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return IMPLS[request.param]


def _inputs(seed, kv_lens, q_lens, dtype=F64):
    """Random q [T, H, Dn+Dr], latent [S, R], k_pe [S, Dr], kv_b [H*(Dn+Dv), R], cu_q, cu_kv."""
    g = torch.Generator().manual_seed(seed)
    T, S = sum(q_lens), sum(kv_lens)
    q = torch.randn(T, H, DN + DR, generator=g, dtype=F64)
    latent = torch.randn(S, R, generator=g, dtype=F64)
    k_pe = torch.randn(S, DR, generator=g, dtype=F64)
    kv_b = torch.randn(H * (DN + DV), R, generator=g, dtype=F64) / math.sqrt(R)
    return [t.to(dtype) for t in (q, latent, k_pe, kv_b)] + [_cu(q_lens), _cu(kv_lens)]


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _paged(rows, kv_lens, page_size, seed, *, spare_pages=3):
    """Scatter rows [S, C] into a NaN-poisoned cache [P, page_size, C] via a shuffled block table.

    Returns (cache, block_table int32 [N, max_pages]); unused table entries point at page 0.
    """
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in kv_lens]
    P = sum(pages) + spare_pages
    perm = torch.randperm(P, generator=g)
    cache = torch.full((P, page_size, rows.shape[1]), float("nan"), dtype=rows.dtype)
    table = torch.zeros(len(kv_lens), max(pages) + 1, dtype=torch.int32)
    start, used = 0, 0
    for n, L in enumerate(kv_lens):
        table[n, : pages[n]] = perm[used : used + pages[n]]
        used += pages[n]
        for p in range(L):
            cache[table[n, p // page_size], p % page_size] = rows[start + p]
        start += L
    return cache, table


def _decode(impl, q, latent, k_pe, kv_b, cu_q, kv_lens, page_size, seed, **kw):
    cache, table = _paged(torch.cat([latent, k_pe], -1), kv_lens, page_size, seed)
    w_uk, w_uv = mla_absorb_weights(kv_b, num_heads=H, qk_nope_head_dim=DN, v_head_dim=DV)
    single = all(b - a == 1 for a, b in zip(cu_q.tolist(), cu_q.tolist()[1:]))
    return impl.mla_decode(q[..., :DN], q[..., DN:], cache, table, torch.tensor(kv_lens), w_uk, w_uv,
                           scale=SCALE, cu_seqlens_q=None if single else cu_q, **kw)


def _prefill(q, latent, k_pe, kv_b, cu_q, cu_kv, **kw):
    return mla_prefill(q, latent, k_pe, kv_b, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, scale=SCALE,
                       qk_nope_head_dim=DN, v_head_dim=DV, **kw)


def _naive(q, latent, k_pe, kv_b, q_lens, kv_lens, selected=None):
    """Per-query, per-head attention with an explicit additive -inf mask; float64."""
    w = kv_b.double().reshape(H, DN + DV, R)
    out, t, s0 = [], 0, 0
    for ql, kl in zip(q_lens, kv_lens):
        c, pe = latent[s0 : s0 + kl].double(), k_pe[s0 : s0 + kl].double()
        ks = [torch.cat([c @ w[h, :DN].T, pe], -1) for h in range(H)]  # H x [kl, Dn+Dr]
        vs = [c @ w[h, DN:].T for h in range(H)]  # H x [kl, Dv]
        for i in range(ql):
            pos = kl - ql + i
            mask = torch.full((kl,), float("-inf"), dtype=F64)
            for s in range(kl) if selected is None else selected[t].tolist():
                if 0 <= s <= pos:
                    mask[s] = 0.0
            heads = []
            for h in range(H):
                z = ks[h] @ q[t, h].double() * SCALE + mask
                p = torch.zeros_like(z) if torch.isinf(z).all() else torch.softmax(z, 0)
                heads.append(p @ vs[h])
            out.append(torch.stack(heads))
            t += 1
        s0 += kl
    return torch.stack(out)


CASES = {  # id: (kv_lens, q_lens, page_size)
    "ragged-decode-kv5,17,33-ps4": ([5, 17, 33], [1, 1, 1], 4),
    "ragged-decode-kv1,9,16-ps16": ([1, 9, 16], [1, 1, 1], 16),
    "verify-kv9,20,4-q4,3,4-ps8": ([9, 20, 4], [4, 3, 4], 8),
    "verify-kv7,12,6-q2,0,5-ps3": ([7, 12, 6], [2, 0, 5], 3),
}


@pytest.mark.parametrize("kv_lens,q_lens,page_size", CASES.values(), ids=CASES.keys())
def test_absorbed_decode_equals_expanded_prefill(kv_lens, q_lens, page_size, impl):
    q, latent, k_pe, kv_b, cu_q, cu_kv = _inputs(1, kv_lens, q_lens)
    ref = _prefill(q, latent, k_pe, kv_b, cu_q, cu_kv)
    out = _decode(impl, q, latent, k_pe, kv_b, cu_q, kv_lens, page_size, seed=2)
    assert out.shape == (sum(q_lens), H, DV) and out.dtype == F64
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    naive = _naive(q, latent, k_pe, kv_b, q_lens, kv_lens)
    torch.testing.assert_close(ref, naive, rtol=0, atol=1e-12)


def test_prefill_with_context_equals_full_prefill_sliced():
    kv_lens, q_lens = [11, 6, 19], [4, 6, 1]
    _, latent, k_pe, kv_b, _, cu_kv = _inputs(3, kv_lens, q_lens)
    g = torch.Generator().manual_seed(4)
    q_full = torch.randn(sum(kv_lens), H, DN + DR, generator=g, dtype=F64)
    full = _prefill(q_full, latent, k_pe, kv_b, cu_kv, cu_kv)
    last = torch.cat([torch.arange(e - n, e) for n, e in zip(q_lens, cu_kv[1:].tolist())])
    cu_q = _cu(q_lens)
    part = _prefill(q_full[last], latent, k_pe, kv_b, cu_q, cu_kv)
    torch.testing.assert_close(part, full[last], rtol=0, atol=1e-12)


def test_chunked_prefill_two_steps_equals_one():
    lens, first = [13, 8], [5, 8]  # second sequence is finished in the first chunk
    q, latent, k_pe, kv_b, cu, _ = _inputs(5, lens, lens)
    one = _prefill(q, latent, k_pe, kv_b, cu, cu)
    starts = cu[:-1].tolist()
    idx1 = torch.cat([torch.arange(s, s + a) for s, a in zip(starts, first)])
    idx2 = torch.cat([torch.arange(s + a, s + n) for s, a, n in zip(starts, first, lens)])
    cu1 = torch.tensor([0, 5, 13])
    step1 = _prefill(q[idx1], latent[idx1], k_pe[idx1], kv_b, cu1, cu1)
    cu_q2 = torch.tensor([0, 8, 8])
    step2 = _prefill(q[idx2], latent, k_pe, kv_b, cu_q2, cu)  # kv = context + new tokens
    torch.testing.assert_close(step1, one[idx1], rtol=0, atol=1e-12)
    torch.testing.assert_close(step2, one[idx2], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=["e4m3fn", "e4m3fnuz"]
)
def test_fp8_cache(fp8, impl):
    kv_lens, q_lens, ps = [7, 24, 15], [1, 3, 2], 8
    q, latent, k_pe, kv_b, cu_q, cu_kv = _inputs(6, kv_lens, q_lens, dtype=torch.float32)
    rows8, s = fp8_quantize(torch.cat([latent, k_pe], -1), dtype=fp8)  # one per-tensor scale
    q8, table = _paged(rows8, kv_lens, ps, seed=7)  # fp8 cache, unused slots fp8 NaN
    w_uk, w_uv = mla_absorb_weights(kv_b, num_heads=H, qk_nope_head_dim=DN, v_head_dim=DV)
    args = (q[..., :DN], q[..., DN:])
    tail = (table, torch.tensor(kv_lens), w_uk, w_uv)
    out8 = impl.mla_decode(*args, q8, *tail, scale=SCALE, cu_seqlens_q=cu_q, kv_cache_scale=s)
    deq = impl.mla_decode(*args, fp8_dequantize(q8, s), *tail, scale=SCALE, cu_seqlens_q=cu_q)
    assert out8.dtype == torch.float32
    torch.testing.assert_close(out8, deq, rtol=1e-5, atol=1e-5)
    ref = _prefill(q.double(), latent.double(), k_pe.double(), kv_b.double(), cu_q, cu_kv)
    assert ((out8.double() - ref).norm() / ref.norm()).item() < 0.05


def test_bf16_within_tolerance(impl):
    kv_lens, q_lens, ps = [10, 21], [2, 1], 4
    q, latent, k_pe, kv_b, cu_q, cu_kv = _inputs(8, kv_lens, q_lens, dtype=torch.bfloat16)
    ref = _prefill(q.double(), latent.double(), k_pe.double(), kv_b.double(), cu_q, cu_kv)
    pre = _prefill(q, latent, k_pe, kv_b, cu_q, cu_kv)
    dec = _decode(impl, q, latent, k_pe, kv_b, cu_q, kv_lens, ps, seed=9)
    for out in (pre, dec):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), ref, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("k", [3, 40], ids=["top3", "top40"])
def test_sparse_prefill_and_decode_match_masked_reference(k, impl):
    kv_lens, q_lens, ps = [9, 26, 5], [3, 2, 5], 4
    q, latent, k_pe, kv_b, cu_q, cu_kv = _inputs(10, kv_lens, q_lens)
    g = torch.Generator().manual_seed(11)
    # random picks over the whole sequence (some non-causal, some repeated), some -1 padding
    sel = torch.randint(-1, max(kv_lens), (sum(q_lens), k), generator=g)
    kv_len_of_row = torch.tensor(kv_lens).repeat_interleave(torch.tensor(q_lens))  # [T]
    sel = torch.where(sel >= kv_len_of_row[:, None], -1, sel)
    ref = _naive(q, latent, k_pe, kv_b, q_lens, kv_lens, selected=sel)
    pre = _prefill(q, latent, k_pe, kv_b, cu_q, cu_kv, topk_indices=sel)
    dec = _decode(impl, q, latent, k_pe, kv_b, cu_q, kv_lens, ps, seed=12, topk_indices=sel.int())
    torch.testing.assert_close(pre, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(dec, ref, rtol=0, atol=1e-12)


def test_nothing_selected_gives_zeros(impl):
    q, latent, k_pe, kv_b, cu_q, cu_kv = _inputs(13, [6], [2])
    sel = torch.full((2, 4), -1)
    out = _prefill(q, latent, k_pe, kv_b, cu_q, cu_kv, topk_indices=sel)
    dec = _decode(impl, q, latent, k_pe, kv_b, cu_q, [6], 4, seed=14, topk_indices=sel)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(dec, torch.zeros_like(dec))


def test_expand_and_absorb_agree():
    _, latent, k_pe, kv_b, _, _ = _inputs(15, [7], [1])
    k, v = mla_expand_kv(latent, k_pe, kv_b, num_heads=H, qk_nope_head_dim=DN, v_head_dim=DV)
    assert k.shape == (7, H, DN + DR) and v.shape == (7, H, DV)
    assert torch.equal(k[..., DN:], k_pe[:, None].expand(-1, H, -1))
    w_uk, w_uv = mla_absorb_weights(kv_b, num_heads=H, qk_nope_head_dim=DN, v_head_dim=DV)
    assert w_uk.shape == (H, DN, R) and w_uv.shape == (H, R, DV)
    k_nope = torch.einsum("sr,hdr->shd", latent, w_uk)
    torch.testing.assert_close(k_nope, k[..., :DN], rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.einsum("sr,hrv->shv", latent, w_uv), v, rtol=0, atol=1e-12)


def test_bad_inputs(impl):
    q, latent, k_pe, kv_b, cu_q, cu_kv = _inputs(16, [6, 4], [2, 1])
    with pytest.raises(ValueError, match="q must be"):
        _prefill(q[..., 1:], latent, k_pe, kv_b, cu_q, cu_kv)
    with pytest.raises(ValueError, match="kv_b_weight"):
        _prefill(q, latent, k_pe, kv_b[1:], cu_q, cu_kv)
    with pytest.raises(ValueError, match="q_len"):
        _prefill(q, latent, k_pe, kv_b, cu_q, torch.tensor([0, 1, 10]))
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        _prefill(q, latent, k_pe, kv_b, cu_q, torch.tensor([0, 6, 9]))
    with pytest.raises(ValueError, match="topk_indices"):
        bad = torch.zeros(2, 4, dtype=torch.long)  # T is 3
        _prefill(q, latent, k_pe, kv_b, cu_q, cu_kv, topk_indices=bad)
    cache, table = _paged(torch.cat([latent, k_pe], -1), [6, 4], 4, seed=0)
    w_uk, w_uv = mla_absorb_weights(kv_b, num_heads=H, qk_nope_head_dim=DN, v_head_dim=DV)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        impl.mla_decode(q[..., :DN], q[..., DN:], cache, table, torch.tensor([6, 4]), w_uk, w_uv,
                   scale=SCALE)  # T = 3 queries for N = 2 sequences needs cu_seqlens_q
    with pytest.raises(ValueError, match="kv_cache_scale"):
        impl.mla_decode(q[:2, :, :DN], q[:2, :, DN:], cache.to(torch.float8_e4m3fn), table,
                   torch.tensor([6, 4]), w_uk, w_uv, scale=SCALE)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit, imported by compile
def test_decode_compiles_fullgraph():
    """The reference platform's decode (the torch kernel) has no host synchronisation:
    torch.compile(fullgraph=True) traces it. (The naive oracle reads the block table on the host.)
    Dynamo's trace is what finds a host sync (a graph break fails fullgraph=True); the aot_eager
    backend runs the traced graph through AOT autograd without inductor's code generation, which
    took 70 of this test's 72 s and checks nothing about host syncs."""
    kv_lens, q_lens, ps = [9, 20, 4], [2, 3, 1], 8
    q, latent, k_pe, kv_b, cu_q, _ = _inputs(17, kv_lens, q_lens, dtype=torch.float32)
    cache, table = _paged(torch.cat([latent, k_pe], -1), kv_lens, ps, seed=18)
    w_uk, w_uv = mla_absorb_weights(kv_b, num_heads=H, qk_nope_head_dim=DN, v_head_dim=DV)
    args = (q[..., :DN], q[..., DN:], cache, table, torch.tensor(kv_lens), w_uk, w_uv)

    def step(*a):
        return torch_decode.mla_decode(*a, scale=SCALE, cu_seqlens_q=cu_q)

    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), step(*args), rtol=1e-5, atol=1e-5)
