"""NoPE MLA (`MLAKernels`): expanded varlen prefill and absorbed paged decode.

Prefill samples mix fresh and chunked-prefill sequences (q_len < kv_len), DSA `topk_indices`
smaller than the context (and larger, mostly padding) and K3's real dims (R 512, Dn 128, Dr 64,
Dv 128). Decode samples read a shuffled block table over pages whose unused rows (past each
sequence's length, and a spare page the table is padded with) are NaN-poisoned; they cover
one query per sequence, speculative verify (several queries per sequence) and DSA top-k.
"""

from __future__ import annotations

import torch

from k3 import reference as ref

from ..inputs import Inputs, causal_topk, cu_seqlens, poisoned, randn, shuffled_pages
from ..registry import Case, Sample, register


def _prefill(q_lens, kv_lens, *, h, r, dn, dr, dv, topk=None):
    def make(g, dtype):
        t, s = sum(q_lens), sum(kv_lens)
        kw = {"cu_seqlens_q": cu_seqlens(q_lens), "cu_seqlens_kv": cu_seqlens(kv_lens),
              "scale": (dn + dr) ** -0.5, "qk_nope_head_dim": dn, "v_head_dim": dv}
        if topk is not None:
            pos = [kv - q + i for q, kv in zip(q_lens, kv_lens) for i in range(q)]
            kw["topk_indices"] = causal_topk(g, pos, topk)
        args = (randn(g, (t, h, dn + dr), dtype), randn(g, (s, r), dtype), randn(g, (s, dr), dtype),
                randn(g, (h * (dn + dv), r), dtype, r ** -0.5))
        return Inputs(args, kw)
    return make


register(Case(
    "mla.prefill", "mla", "mla.prefill", reference=ref.mla_prefill, outputs=lambda o, a, k: {"o": o},
    samples=(
        Sample("ragged3_q5-7-1_kv5-20-13_H4_R32_Dn16_Dr8_Dv16",
               _prefill((5, 7, 1), (5, 20, 13), h=4, r=32, dn=16, dr=8, dv=16)),
        Sample("dsa_topk8_ragged2_q9-4_kv9-30_H4_R32",
               _prefill((9, 4), (9, 30), h=4, r=32, dn=16, dr=8, dv=16, topk=8)),
        Sample("real_dims_ragged2_q6-3_kv6-40_H2_R512_Dn128_Dr64_Dv128",
               _prefill((6, 3), (6, 40), h=2, r=512, dn=128, dr=64, dv=128)),
        Sample("dsa_topk16_exceeds_context_q3_kv3_H2", _prefill((3,), (3,), h=2, r=32, dn=16, dr=8, dv=16, topk=16)),
        Sample("dsa_topk128_chunk_q40_kv300_H4_R512_Dn128_Dr64_Dv128",
               _prefill((40,), (300,), h=4, r=512, dn=128, dr=64, dv=128, topk=128)),
    ),
    doc="Expanded (MHA) varlen MLA, causal within each sequence's context, optional DSA top-k."))


def decode_inputs(g, dtype, *, seq_lens, q_lens=None, h, r, dn, dr, dv, page_size, topk=None,
                  page_dtype=None, kv_scale=None, seq_lens_dtype=torch.int64):
    """Inputs of one mla.decode call over poisoned, shuffled pages (shared with the cache cases).

    page_dtype: the cache's dtype (default: the activation dtype); an fp8 dtype stores the
    latents quantised with the per-tensor `kv_scale`."""
    page_dtype = page_dtype or dtype
    table, num_pages, spare = shuffled_pages(g, seq_lens, page_size)
    pages = poisoned((num_pages, page_size, r + dr), torch.float64)
    for n, length in enumerate(seq_lens):
        for p in range(length):
            pages[table[n, p // page_size], p % page_size] = randn(g, (r + dr,), torch.float64)
    if kv_scale is not None:                       # store q = x / scale in fp8 (NaN stays NaN)
        fmax = torch.finfo(page_dtype).max
        pages = (pages / kv_scale).clamp(-fmax, fmax)
    pages = pages.to(page_dtype)
    q_lens = q_lens or [1] * len(seq_lens)
    w_uk, w_uv = ref.mla_absorb_weights(randn(g, (h * (dn + dv), r), dtype, r ** -0.5), num_heads=h,
                                        qk_nope_head_dim=dn, v_head_dim=dv)
    t = sum(q_lens)
    kw = {"scale": (dn + dr) ** -0.5}
    if any(q != 1 for q in q_lens):
        kw["cu_seqlens_q"] = cu_seqlens(q_lens)
    if kv_scale is not None:
        kw["kv_cache_scale"] = torch.tensor(kv_scale, dtype=torch.float32)
    if topk is not None:
        kw["topk_indices"] = causal_topk(g, [n - q + i for q, n in zip(q_lens, seq_lens) for i in range(q)], topk)
    args = (randn(g, (t, h, dn), dtype), randn(g, (t, h, dr), dtype), pages, table,
            torch.tensor(seq_lens, dtype=seq_lens_dtype), w_uk, w_uv)
    return Inputs(args, kw)


def _decode(**spec):
    return lambda g, dtype: decode_inputs(g, dtype, **spec)


SMALL = {"h": 4, "r": 32, "dn": 16, "dr": 8, "dv": 16}

register(Case(
    "mla.decode", "mla", "mla.decode", reference=ref.mla_decode, outputs=lambda o, a, k: {"o": o},
    samples=(
        Sample("N3_ps16_lens7-40-16_H4_R32_Dr8_shuffled_poisoned",
               _decode(seq_lens=(7, 40, 16), page_size=16, **SMALL)),
        Sample("verify_q1-3-2_N3_ps16_lens9-21-33", _decode(seq_lens=(9, 21, 33), q_lens=(1, 3, 2), page_size=16,
                                                            seq_lens_dtype=torch.int32, **SMALL)),
        Sample("dsa_topk8_N2_ps16_lens30-12", _decode(seq_lens=(30, 12), page_size=16, topk=8, **SMALL)),
        Sample("real_dims_N2_ps64_lens70-130_H2_R512_Dr64",
               _decode(seq_lens=(70, 130), page_size=64, h=2, r=512, dn=128, dr=64, dv=128)),
        Sample("dsa_topk128_N4_ps64_lens300-65-129-1_H4_R512_Dr64",
               _decode(seq_lens=(300, 65, 129, 1), page_size=64, topk=128, h=4, r=512, dn=128, dr=64, dv=128)),
        # AMD's AITER MLA decode takes 16 or 128 heads: runs where it serves
        Sample("aiter_dsa_topk64_N2_ps64_lens100-70_H16_R512_Dr64", _decode(
            seq_lens=(100, 70), page_size=64, topk=64, h=16, r=512, dn=128, dr=64, dv=128), requires=("aiter",)),
    ),
    doc="Absorbed (MQA) MLA over a paged latent cache, no host sync; poisoned pages must not leak."))
