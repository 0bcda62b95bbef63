"""DSA indexer reference: Hadamard, key codecs and pages, scores, top-k, and DSA feeding MLA. The
Hadamard transform is checked on both implementations: the oracle's explicit Sylvester matrix
(k3.reference) and the butterfly the reference platform serves (k3.platforms.torch_kernels)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from k3 import reference as ref
from k3.platforms.torch_kernels import hadamard as torch_hadamard
from k3.reference.indexer import (
    index_key_record_bytes,
    indexer_dequantize_keys,
    indexer_quantize_keys,
    indexer_scores,
    indexer_topk,
    pack_index_key_page,
    unpack_index_key_page,
)
from k3.reference.mla import mla_absorb_weights, mla_decode, mla_prefill

F64 = torch.float64
H, DN, DR, DV, R = 4, 16, 8, 12, 32  # MLA dims for the end-to-end test
SCALE = 1.0 / math.sqrt(DN + DR)
IMPLS = {"reference": SimpleNamespace(hadamard_transform=ref.hadamard_transform),
         "torch": SimpleNamespace(hadamard_transform=torch_hadamard.hadamard_transform)}


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return IMPLS[request.param]


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _sylvester(n):
    m = torch.ones(1, 1, dtype=F64)
    while m.shape[0] < n:
        m = torch.cat([torch.cat([m, m], 1), torch.cat([m, -m], 1)], 0)
    return m / math.sqrt(n)


# ---------------------------------------------------------------------------- Hadamard
@pytest.mark.parametrize("n", [1, 2, 16, 128], ids=lambda n: f"n{n}")
def test_hadamard_orthonormal_involution_sylvester(n, impl):
    m = impl.hadamard_transform(torch.eye(n, dtype=F64))  # row i = H e_i
    torch.testing.assert_close(m @ m.T, torch.eye(n, dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(m, _sylvester(n), rtol=0, atol=1e-15)
    x = torch.randn(3, 5, n, generator=torch.Generator().manual_seed(n), dtype=F64)
    torch.testing.assert_close(impl.hadamard_transform(impl.hadamard_transform(x)), x, rtol=0, atol=1e-12)
    torch.testing.assert_close(impl.hadamard_transform(x), x @ _sylvester(n), rtol=0, atol=1e-12)


def test_hadamard_bf16_and_bad_length(impl):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y = impl.hadamard_transform(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), x.double() @ _sylvester(64), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="power of two"):
        impl.hadamard_transform(torch.randn(2, 96))


# ---------------------------------------------------------------------------- key codecs and pages
@pytest.mark.parametrize("S,D", [(17, 128), (5, 64)], ids=["S17xD128", "S5xD64"])
def test_index_keys_round_trip(S, D, impl):
    k = impl.hadamard_transform(torch.randn(S, D, generator=torch.Generator().manual_seed(S), dtype=F64))
    keys = indexer_quantize_keys(k, fmt="fp8")
    v8, s8 = keys.values, keys.scales
    assert v8.dtype == torch.float8_e4m3fn and v8.shape == (S, D)
    assert s8.dtype == torch.float32 and s8.shape == (S,)
    torch.testing.assert_close(s8.double(), k.abs().amax(-1) / 448, rtol=2**-23, atol=0)
    err = (indexer_dequantize_keys(v8, s8, fmt="fp8", dtype=F64) - k).abs()
    half_ulp = torch.maximum(k.abs() * 2**-4, s8.double()[:, None] * 2**-10)  # normals | subnormals
    assert err.le(half_ulp * (1 + 1e-6)).all()

    keys = indexer_quantize_keys(k, fmt="mxfp4")
    v4, s4 = keys.values, keys.scales
    assert v4.dtype == torch.uint8 and v4.shape == (S, D // 2)
    assert s4.dtype == torch.uint8 and s4.shape == (S, D // 32)
    err = (indexer_dequantize_keys(v4, s4, fmt="mxfp4", dtype=F64) - k).abs()
    step = torch.exp2(s4.double() - 127).repeat_interleave(32, -1)  # 2^shared_exp per element
    assert err.le(2 * step).all()  # half an E2M1 step at the top binade, or the OCP clip 8 -> 6
    assert (err.norm() / k.norm()).item() < 0.2


@pytest.mark.parametrize("fmt,record", [("fp8", 132), ("mxfp4", 68)], ids=["fp8", "mxfp4"])
def test_index_key_page_pack_unpack_exact(fmt, record):
    page_tokens, D = 64, 128
    assert index_key_record_bytes(D, fmt) == record
    k = torch.randn(page_tokens, D, generator=torch.Generator().manual_seed(record))
    keys = indexer_quantize_keys(k, fmt=fmt)
    values, scales = keys.values, keys.scales
    page = pack_index_key_page(values, scales, fmt=fmt)
    assert page.dtype == torch.uint8 and page.shape == (page_tokens * record,)
    vbytes = values.view(torch.uint8).reshape(-1)
    assert torch.equal(page[: vbytes.numel()], vbytes)  # all values first, then all scales
    assert torch.equal(page[vbytes.numel() :], scales.contiguous().view(torch.uint8).reshape(-1))
    v2, s2 = unpack_index_key_page(page, head_dim=D, fmt=fmt)
    assert v2.dtype == values.dtype and s2.dtype == scales.dtype
    assert torch.equal(v2.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(s2.view(torch.uint8), scales.view(torch.uint8))
    with pytest.raises(ValueError, match="page must be"):
        unpack_index_key_page(page[1:], head_dim=D, fmt=fmt)


# ---------------------------------------------------------------------------- scores and top-k
def _naive_scores(q, w, keys, q_lens, kv_lens, quantize_query):
    """Per-(t, s, h) loop in float64; the query is fp8-rounded per (t, h) when asked."""
    T, Hi, _ = q.shape
    out = torch.full((T, max(kv_lens)), float("-inf"), dtype=F64)
    t, s0 = 0, 0
    for ql, kl in zip(q_lens, kv_lens):
        for i in range(ql):
            for s in range(kl - ql + i + 1):
                total = 0.0
                for h in range(Hi):
                    qh = q[t, h].double()
                    if quantize_query:
                        sc = (qh.abs().max() / 448).float().double()
                        qh = (qh / sc).to(torch.float8_e4m3fn).double() * sc
                    total += w[t, h].item() * max(0.0, (qh @ keys[s0 + s].double()).item())
                out[t, s] = total
            t += 1
        s0 += kl
    return out


@pytest.mark.parametrize("quantize_query", [False, True], ids=["q-exact", "q-fp8"])
@pytest.mark.parametrize("Hi,D", [(4, 32), (32, 128)], ids=["Hi4xD32", "Hi32xD128"])
def test_scores_match_naive_loop(Hi, D, quantize_query, impl):
    q_lens, kv_lens = [3, 1, 4], [5, 6, 4]
    g = torch.Generator().manual_seed(Hi + D)
    q = impl.hadamard_transform(torch.randn(sum(q_lens), Hi, D, generator=g, dtype=F64))
    keys = impl.hadamard_transform(torch.randn(sum(kv_lens), D, generator=g, dtype=F64))
    w = torch.randn(sum(q_lens), Hi, generator=g, dtype=F64) * Hi**-0.5 * D**-0.5
    got = indexer_scores(q, w, keys, cu_seqlens_q=_cu(q_lens), cu_seqlens_kv=_cu(kv_lens),
                         quantize_query=quantize_query)
    ref = _naive_scores(q, w, keys, q_lens, kv_lens, quantize_query)
    assert got.dtype == F64 and got.shape == ref.shape
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    got32 = indexer_scores(q.float(), w.float(), keys.float(), cu_seqlens_q=_cu(q_lens),
                           cu_seqlens_kv=_cu(kv_lens), quantize_query=quantize_query)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), ref, rtol=1e-4, atol=1e-5)


def test_topk_order_ties_and_padding():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (6, 10), generator=g).float()  # many ties
    scores[torch.rand(6, 10, generator=g) < 0.3] = float("-inf")
    scores[0, 3] = float("nan")
    for topk in (3, 10, 12):
        got = indexer_topk(scores, topk=topk)
        assert got.dtype == torch.int32 and got.shape == (6, topk)
        for t in range(6):
            finite = [s for s in range(10) if math.isfinite(scores[t, s].item())]
            want = sorted(finite, key=lambda s: (-scores[t, s].item(), s))[:topk]
            assert got[t].tolist() == want + [-1] * (topk - len(want))


def test_topk_covering_context_selects_all_causal_positions():
    q_lens, kv_lens, D, Hi = [6, 2], [6, 9], 32, 4
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(q_lens), Hi, D, generator=g)
    keys = torch.randn(sum(kv_lens), D, generator=g)
    w = torch.rand(sum(q_lens), Hi, generator=g)
    scores = indexer_scores(q, w, keys, cu_seqlens_q=_cu(q_lens), cu_seqlens_kv=_cu(kv_lens))
    sel = indexer_topk(scores, topk=16)
    positions = [p for ql, kl in zip(q_lens, kv_lens) for p in range(kl - ql, kl)]
    for t, pos in enumerate(positions):
        row = sel[t].tolist()
        assert sorted(row[: pos + 1]) == list(range(pos + 1))
        assert row[pos + 1 :] == [-1] * (15 - pos)


# ---------------------------------------------------------------------------- DSA end to end
def _dense_masked_attention(q, latent, k_pe, kv_b, q_lens, kv_lens, selected):
    """Dense MHA reference with an additive mask: 0 on selected causal positions, -inf elsewhere."""
    k_nope_w, v_w = kv_b.reshape(H, DN + DV, R).split([DN, DV], dim=1)
    out, t0, s0 = [], 0, 0
    for ql, kl in zip(q_lens, kv_lens):
        c = latent[s0 : s0 + kl]
        k_nope = torch.einsum("sr,hdr->hsd", c, k_nope_w)  # [H, kl, Dn]
        k = torch.cat([k_nope, k_pe[s0 : s0 + kl].expand(H, -1, -1)], -1)  # [H, kl, Dn+Dr]
        v = torch.einsum("sr,hdr->hsd", c, v_w)  # [H, kl, Dv]
        mask = torch.full((ql, kl), float("-inf"), dtype=F64)
        for i in range(ql):
            for s in selected[t0 + i].tolist():
                if 0 <= s <= kl - ql + i:
                    mask[i, s] = 0.0
        z = torch.einsum("thd,hsd->hts", q[t0 : t0 + ql], k) * SCALE + mask
        out.append(torch.einsum("hts,hsd->thd", torch.softmax(z, -1), v))
        t0, s0 = t0 + ql, s0 + kl
    return torch.cat(out)


def _paged(rows, kv_lens, page_size, g):
    """rows [S, C] -> NaN-poisoned cache [P, page_size, C] and a shuffled block table."""
    pages = [-(-n // page_size) for n in kv_lens]
    perm = torch.randperm(sum(pages) + 2, generator=g)
    cache = torch.full((len(perm), page_size, rows.shape[1]), float("nan"), dtype=rows.dtype)
    table = torch.zeros(len(kv_lens), max(pages), dtype=torch.int32)
    s0, used = 0, 0
    for n, L in enumerate(kv_lens):
        table[n, : pages[n]] = perm[used : used + pages[n]]
        for p in range(L):
            cache[table[n, p // page_size], p % page_size] = rows[s0 + p]
        s0, used = s0 + L, used + pages[n]
    return cache, table


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("topk", [4, 64], ids=["top4", "top64-covers-context"])
def test_dsa_end_to_end(topk, fmt, impl):
    q_lens, kv_lens, Hi, D, page_size = [10, 3, 1], [10, 23, 17], 4, 32, 4
    g = torch.Generator().manual_seed(topk)
    T, S = sum(q_lens), sum(kv_lens)
    # indexer: rotated queries and keys, keys through the cache codec
    q_idx = impl.hadamard_transform(torch.randn(T, Hi, D, generator=g))
    k_idx = impl.hadamard_transform(torch.randn(S, D, generator=g))
    keys = indexer_dequantize_keys(*dataclasses.astuple(indexer_quantize_keys(k_idx, fmt=fmt)), fmt=fmt)
    w = torch.randn(T, Hi, generator=g) * Hi**-0.5 * D**-0.5
    cu_q, cu_kv = _cu(q_lens), _cu(kv_lens)
    scores = indexer_scores(q_idx, w, keys, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    sel = indexer_topk(scores, topk=topk)
    # MLA inputs (float64)
    q = torch.randn(T, H, DN + DR, generator=g, dtype=F64)
    latent = torch.randn(S, R, generator=g, dtype=F64)
    k_pe = torch.randn(S, DR, generator=g, dtype=F64)
    kv_b = torch.randn(H * (DN + DV), R, generator=g, dtype=F64) / math.sqrt(R)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, scale=SCALE, qk_nope_head_dim=DN,
              v_head_dim=DV)
    sparse = mla_prefill(q, latent, k_pe, kv_b, topk_indices=sel, **kw)
    cache, table = _paged(torch.cat([latent, k_pe], -1), kv_lens, page_size, g)
    w_uk, w_uv = mla_absorb_weights(kv_b, num_heads=H, qk_nope_head_dim=DN, v_head_dim=DV)
    decoded = mla_decode(q[..., :DN], q[..., DN:], cache, table, torch.tensor(kv_lens), w_uk, w_uv,
                         scale=SCALE, cu_seqlens_q=cu_q, topk_indices=sel)
    if topk >= max(kv_lens):
        ref = mla_prefill(q, latent, k_pe, kv_b, **kw)  # dense MLA
    else:
        assert (sel >= 0).sum(1).min().item() == 1 and (sel >= 0).sum(1).max().item() == topk
        ref = _dense_masked_attention(q, latent, k_pe, kv_b, q_lens, kv_lens, sel)
        assert not torch.allclose(ref, mla_prefill(q, latent, k_pe, kv_b, **kw))  # really sparse
    torch.testing.assert_close(sparse, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(decoded, ref, rtol=0, atol=1e-12)


def test_bad_inputs():
    with pytest.raises(ValueError, match="fmt"):
        indexer_quantize_keys(torch.randn(2, 32), fmt="int8")
    with pytest.raises(ValueError, match="head_weights"):
        indexer_scores(torch.randn(2, 4, 32), torch.randn(2, 3), torch.randn(2, 32),
                       cu_seqlens_q=_cu([2]), cu_seqlens_kv=_cu([2]))
    with pytest.raises(ValueError, match="topk"):
        indexer_topk(torch.randn(2, 5), topk=0)
    with pytest.raises(ValueError, match="scales"):
        values = indexer_quantize_keys(torch.randn(3, 32)).values
        pack_index_key_page(values, torch.ones(2), fmt="fp8")
