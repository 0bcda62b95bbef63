"""DSA lightning indexer (`IndexerKernels`): key codecs, scores, decode scores, exact top-k,
the Hadamard rotation.

Top-k selections are compared as sets with ties resolved either way (score inputs are built
with many exact ties). Decode scores read padded keys whose padding is NaN-poisoned (what the
model's padded page reads see), and must mask it; paged decode scores read the quantised cache
pages themselves, NaN-poisoned past each sequence.
"""

from __future__ import annotations

import torch

from k3 import reference as ref

from .. import compare as cmp
from ..inputs import Inputs, cu_seqlens, poisoned, randn, state_dtype
from ..registry import Case, Sample, register
from .quant import CODEC_TOL, fp8_codes, pin_block_max, representable_mxfp4


def _quantize_keys(s, d, fmt, *, representable):
    def make(g, dtype):
        if representable and fmt == "fp8":      # one element per token at 448 * 2^e
            x = pin_block_max(g, fp8_codes(g, (s, d)), d, 448.0)
            x = x * torch.exp2(torch.randint(-9, 0, (s, 1), generator=g).double())
        elif representable:
            x = representable_mxfp4(g, (s, d))
        else:
            x = randn(g, (s, d), torch.float64)
        return Inputs((x.to(dtype),), {"fmt": fmt})
    return make


def _quantize_keys_outputs(result, args, kwargs):
    values, scales = result.values, result.scales
    return {"values": values, "scales": scales,
            "decoded": ref.indexer_dequantize_keys(values.cpu(), scales.cpu(), fmt=kwargs["fmt"], dtype=torch.float64)}


EXACT_CODEC = {"decoded": "skip", "values": "exact", "scales": "exact"}
RANDOM_FP8 = {"values": "skip", "scales": "close"}
RANDOM_MX = {"values": "skip", "scales": "exact"}

register(Case(
    "indexer.quantize_keys", "indexer", "indexer.quantize_keys", reference=ref.indexer_quantize_keys,
    outputs=_quantize_keys_outputs, tolerances=CODEC_TOL,
    samples=(
        Sample("fp8_S33_D128_representable", _quantize_keys(33, 128, "fp8", representable=True), requires=("fp8",),
               compare=EXACT_CODEC),
        Sample("fp8_S40_D64_random", _quantize_keys(40, 64, "fp8", representable=False), requires=("fp8",),
               compare=RANDOM_FP8),
        Sample("mxfp4_S33_D128_representable", _quantize_keys(33, 128, "mxfp4", representable=True),
               compare=EXACT_CODEC),
        Sample("mxfp4_S17_D64_random", _quantize_keys(17, 64, "mxfp4", representable=False), compare=RANDOM_MX),
    ),
    doc="Index keys to fp8 (one amax/448 scale per token) or MXFP4."))


def _dequantize_keys(s, d, fmt, *, pow2=True):
    def make(g, dtype):
        if fmt == "fp8":
            values = fp8_codes(g, (s, d)).to(torch.float8_e4m3fn)
            scales = (torch.exp2(torch.randint(-12, 0, (s,), generator=g).double()) if pow2
                      else torch.rand((s,), generator=g, dtype=torch.float64) + 0.01).float()
        else:
            values = torch.randint(0, 256, (s, d // 2), generator=g, dtype=torch.uint8)
            scales = torch.randint(115, 135, (s, d // 32), generator=g, dtype=torch.uint8)
        return Inputs((values, scales), {"fmt": fmt, "dtype": dtype})
    return make


register(Case(
    "indexer.dequantize_keys", "indexer", "indexer.dequantize_keys", reference=ref.indexer_dequantize_keys,
    outputs=lambda o, a, k: {"keys": o},
    samples=(
        Sample("fp8_S40_D128_pow2_scales", _dequantize_keys(40, 128, "fp8"), requires=("fp8",),
               compare={"keys": "exact"}),
        Sample("fp8_S25_D64_random_scales", _dequantize_keys(25, 64, "fp8", pow2=False), requires=("fp8",)),
        Sample("mxfp4_S33_D128", _dequantize_keys(33, 128, "mxfp4"), compare={"keys": "exact"}),
    ),
    doc="Cached index keys back to floats (the dtype argument is the output dtype)."))


def _scores(q_lens, kv_lens, hi, d, *, quantize_query=True):
    def make(g, dtype):
        t, s = sum(q_lens), sum(kv_lens)
        sd = state_dtype(dtype)
        args = (randn(g, (t, hi, d), dtype), randn(g, (t, hi), sd, (hi * d) ** -0.5), randn(g, (s, d), sd))
        return Inputs(args, {"cu_seqlens_q": cu_seqlens(q_lens), "cu_seqlens_kv": cu_seqlens(kv_lens),
                             "quantize_query": quantize_query})
    return make


register(Case(
    "indexer.scores", "indexer", "indexer.scores", reference=ref.indexer_scores,
    outputs=lambda o, a, k: {"scores": o},
    samples=(
        Sample("ragged3_q20-1-9_kv20-45-9_Hi4_D32_fp8_query", _scores((20, 1, 9), (20, 45, 9), 4, 32)),
        Sample("ragged2_q7-3_kv7-30_Hi8_D64_no_query_quant", _scores((7, 3), (7, 30), 8, 64, quantize_query=False)),
        Sample("real_ragged2_q12-1_kv12-60_Hi32_D128", _scores((12, 1), (12, 60), 32, 128)),
        Sample("ragged3_q5-0-17_kv40-3-17_Hi16_D32", _scores((5, 0, 17), (40, 3, 17), 16, 32)),
        Sample("real_chunk_q64_kv300_Hi32_D128", _scores((64,), (300,), 32, 128)),
    ),
    doc="I(t, s) = sum_h w[t, h] ReLU(q[t, h] . k[s]), causal, -inf masked."))


def _decode_scores(lens, width, hi, d, *, quantize_query=True):
    def make(g, dtype):
        n, sd = len(lens), state_dtype(dtype)
        keys = poisoned((n, width, d), sd)
        for i, length in enumerate(lens):
            keys[i, :length] = randn(g, (length, d), sd)
        args = (randn(g, (n, hi, d), dtype), randn(g, (n, hi), sd, (hi * d) ** -0.5), keys,
                torch.tensor(lens, dtype=torch.int64))
        return Inputs(args, {"quantize_query": quantize_query})
    return make


if hasattr(ref, "indexer_decode_scores"):
    register(Case(
        "indexer.decode_scores", "indexer", "indexer.decode_scores", reference=ref.indexer_decode_scores,
        outputs=lambda o, a, k: {"scores": o},
        samples=(
            Sample("N3_L48_lens7-48-30_Hi4_D32_nan_padding", _decode_scores((7, 48, 30), 48, 4, 32)),
            Sample("N2_L64_lens64-1_Hi32_D128_real", _decode_scores((64, 1), 64, 32, 128)),
            Sample("N2_L32_lens5-20_Hi8_D64_no_query_quant", _decode_scores((5, 20), 32, 8, 64,
                                                                           quantize_query=False)),
        ),
        doc="One query per sequence over padded keys (no host sync); padding may hold anything."))


def _paged_decode_scores(lens, page, hi, d, fmt, *, quantize_query=True):
    """Quantised keys written position by position into shuffled cache pages of a pool with
    NaN-poisoned slots (values and scales) past each sequence and in unused pages; each
    sequence's unused table entries point at a poisoned page."""
    def make(g, dtype):
        n, sd = len(lens), state_dtype(dtype)
        pages_each = -(-max(lens) // page)
        pool = n * pages_each + 1                                   # the last page is never written
        perm = torch.randperm(pool - 1, generator=g)
        width = (d if fmt == "fp8" else d // 2)
        if fmt == "fp8":
            values = poisoned((pool, page, width), torch.float8_e4m3fn)
            scales = poisoned((pool, page), torch.float32)
        else:
            values = poisoned((pool, page, width), torch.uint8)
            scales = poisoned((pool, page, d // 32), torch.uint8)
        table = torch.full((n, pages_each), pool - 1, dtype=torch.int32)
        for i, length in enumerate(lens):
            used = -(-length // page)
            table[i, :used] = perm[i * pages_each: i * pages_each + used].to(torch.int32)
            keys = ref.indexer_quantize_keys(randn(g, (length, d), torch.float32), fmt=fmt)
            v, sc = keys.values, keys.scales
            pos = torch.arange(length)
            values[table[i, pos // page].long(), pos % page] = v
            scales[table[i, pos // page].long(), pos % page] = sc
        args = (randn(g, (n, hi, d), dtype), randn(g, (n, hi), sd, (hi * d) ** -0.5), values, scales, table,
                torch.tensor(lens, dtype=torch.int64))
        return Inputs(args, {"fmt": fmt, "quantize_query": quantize_query})
    return make


register(Case(
    "indexer.paged_decode_scores", "indexer", "indexer.paged_decode_scores",
    reference=ref.indexer_paged_decode_scores, outputs=lambda o, a, k: {"scores": o},
    samples=(
        Sample("fp8_N3_page16_lens7-48-30_Hi16_D32_poisoned", _paged_decode_scores((7, 48, 30), 16, 16, 32, "fp8"),
               requires=("fp8",)),
        Sample("fp8_N2_page64_lens130-1_Hi32_D128_real", _paged_decode_scores((130, 1), 64, 32, 128, "fp8"),
               requires=("fp8",)),
        Sample("fp8_N2_page16_lens5-20_Hi16_D64_no_query_quant",
               _paged_decode_scores((5, 20), 16, 16, 64, "fp8", quantize_query=False), requires=("fp8",)),
        Sample("fp8_N2_page8_lens3-17_Hi4_D32_few_heads", _paged_decode_scores((3, 17), 8, 4, 32, "fp8"),
               requires=("fp8",)),
        Sample("mxfp4_N2_page16_lens9-33_Hi4_D64", _paged_decode_scores((9, 33), 16, 4, 64, "mxfp4")),
        # 68-byte MXFP4 keys at K3.1 Pro's width, heads the Triton kernel takes (indexer_decode_mxfp4.covers)
        Sample("mxfp4_N2_page16_lens9-40_Hi16_D128_poisoned", _paged_decode_scores((9, 40), 16, 16, 128, "mxfp4")),
    ),
    doc="Decode scores over the index-key cache pages (fp8 or MXFP4) through the block table; "
        "poisoned slots past each sequence must be masked."))


def _topk(rows, width, k, *, levels=8, causal=True):
    """Scores rounded to `levels` distinct values (many ties) with causal / ragged -inf masks."""
    def make(g, dtype):
        s = torch.randint(0, levels, (rows, width), generator=g).double() / levels
        s = s + torch.randn((rows, width), generator=g, dtype=torch.float64).round() * 0.5
        if causal:      # row t sees positions <= t + width - rows
            valid = torch.arange(width)[None, :] <= torch.arange(rows)[:, None] + (width - rows)
        else:
            valid = torch.arange(width)[None, :] < torch.randint(1, width + 1, (rows, 1), generator=g)
        return Inputs((s.masked_fill(~valid, float("-inf")).to(dtype),), {"topk": k})
    return make


def _topk_compare(name, out, ref_out, tol, ref_inputs):
    return cmp.topk_sets(name, out, ref_out, ref_inputs.args[0])


register(Case(
    "indexer.topk", "indexer", "indexer.topk", reference=ref.indexer_topk, dtypes=("float32", "float64"),
    outputs=lambda o, a, k: {"indices": o}, compare={"indices": _topk_compare},
    samples=(
        Sample("causal_T40_L40_k16_ties", _topk(40, 40, 16)),
        Sample("ragged_T24_L50_k8_ties", _topk(24, 50, 8, causal=False)),
        Sample("k64_exceeds_L40_padding", _topk(12, 40, 64)),
        Sample("T4_L2500_k2048_real", _topk(4, 2500, 2048, levels=1000)),
    ),
    doc="Exact top-k of finite scores, -1 padded; compared as sets, ties either way."))


register(Case(
    "indexer.hadamard", "indexer", "indexer.hadamard", reference=ref.hadamard_transform,
    samples=(
        Sample("T37_H4_D128", lambda g, dtype: Inputs((randn(g, (37, 4, 128), dtype),))),
        Sample("T9_D64", lambda g, dtype: Inputs((randn(g, (9, 64), dtype),))),
        Sample("B2_T3_D2", lambda g, dtype: Inputs((randn(g, (2, 3, 2), dtype),))),
        Sample("T5_D256", lambda g, dtype: Inputs((randn(g, (5, 256), dtype),))),
    ),
    doc="Orthonormal Sylvester Hadamard rotation over the last axis."))
