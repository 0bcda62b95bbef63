"""Variants of one kernel entry (family variants, issue 32): the same rows computed through every
variant a platform may pick for them must agree at the bf16 rounding points
(`compare.variants_agree`: an error ratio of a quarter of bf16's unit roundoff, derived there).

A platform picks a variant of an entry by the batch (size, composition) or the step kind, so each
case computes a few probe rows alone and then inside batches that cross the usual switch points,
through the platform's entry as the model calls it; the probes' results must not move beyond fp32
accumulation order. Inputs are fresh seeded random values; outputs are new tensors (the caching
allocator's free memory is NaN-poisoned before each call, so a row read from unwritten memory
fails the finite check).

- variants.moe.experts: 8 tokens alone (decode of one), among 63 others (a decode batch) with
  both dispatches, and among 1,032 others (a prefill chunk). nvidia: the gemv (up to 16
  tokens), the tensor-core tiles, the dequantised grouped GEMMs (from 1,024).
- variants.moe.router_logits: rows alone, in 3 (nvidia's one-launch Triton form, up to 4 tokens)
  and in 64 (the torch product); fp32 logits.
- variants.mla.decode: queries of sequences alone, inside a 64-sequence batch (another split
  count: nvidia splits each query's context by the batch's size), as the last token of a 3-token
  verify step (`cu_seqlens_q`), and through a DSA selection naming every position (the sparse
  path). bf16 and fp8 pages.
- variants.kda (cases/variants_kda.py): a sequence's tokens through the fused decode step, the
  unfused one-token step, the chunked prefill (alone and packed with others) and the verify
  recurrence.
"""

from __future__ import annotations

import torch

from k3 import reference as ref
from k3.quant.mxfp4 import MXFP4Tensor

from .. import compare as cmp
from ..inputs import TORCH_DTYPES, poison_freed_memory, randn, state_dtype, synchronize, to_cpu, to_device
from ..registry import Case, Sample, register
from .mla import decode_inputs

DTYPES = ("bfloat16", "float32")


def _call(ctx, fn, *args, **kwargs):
    """fn on the platform's device (tensor arguments moved there), its tensors back on the CPU."""
    poison_freed_memory(ctx.device)
    out = fn(*to_device(args, ctx.device), **to_device(kwargs, ctx.device))
    synchronize(ctx.device)
    return to_cpu(out)


def _embed(rows: torch.Tensor, probes: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """probes [P, ...] at `rows` of a batch, others [B - P, ...] in the rest, in order: [B, ...]."""
    total = probes.shape[0] + others.shape[0]
    batch = torch.empty((total, *probes.shape[1:]), dtype=probes.dtype)
    mask = torch.ones(total, dtype=torch.bool)
    mask[rows] = False
    batch[rows], batch[mask] = probes, others
    return batch


# ------------------------------------------------------------------------------------ MoE
def _mxfp4(g, experts, out, fan_in):
    """Random MXFP4 codes with E8M0 scales giving weights of rms ~ 1/sqrt(fan_in) (cases/moe.py)."""
    packed = torch.randint(0, 256, (experts, out, fan_in // 2), generator=g, dtype=torch.uint8)
    exp = round(-0.5 * torch.log2(torch.tensor(float(fan_in))).item()) - 1
    scales = (127 + exp + torch.randint(-1, 1, (experts, out, fan_in // 32), generator=g)).to(torch.uint8)
    return MXFP4Tensor(packed, scales)


def _routing(g, t, e, k, dtype):
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])            # [T, k]
    weights = torch.rand((t, k), generator=g, dtype=torch.float64).add(0.1).to(state_dtype(dtype))
    return ids, weights


def _moe_experts(ctx, item):
    p, dtype = item.sample.params, TORCH_DTYPES[item.dtype]
    g = torch.Generator().manual_seed(item.seed)
    e, k, l, i, n = p["experts"], p["top_k"], p["latent"], p["inter"], p["probes"]
    w13, w2 = _mxfp4(g, e, 2 * i, l), _mxfp4(g, e, l, i)
    kw = {"activation": "situ", "beta": 4.0, "linear_beta": 25.0}
    x = randn(g, (n, l), dtype)
    ids, weights = _routing(g, n, e, k, dtype)
    experts = ctx.platform.kernels.moe.experts
    alone = torch.cat([_call(ctx, experts, x[r: r + 1], w13, w2, weights[r: r + 1], ids[r: r + 1], **kw)
                       for r in range(n)])
    outcome = cmp.Outcome()
    oracle = ref.experts_forward(x.double(), w13, w2, weights.double(), ids, **kw)
    outcome.outputs.append(cmp.close("alone_vs_oracle", alone, oracle, item.case.tolerance(item.dtype)))
    for size, dense in p["batches"]:
        other_ids, other_weights = _routing(g, size - n, e, k, dtype)
        rows = torch.randperm(size, generator=g)[:n]
        xb, idb, wb = (_embed(rows, a, b) for a, b in ((x, randn(g, (size - n, l), dtype)), (ids, other_ids),
                                                       (weights, other_weights)))
        got = _call(ctx, experts, xb, w13, w2, wb, idb, dense_dispatch=dense, **kw)[rows]
        name = f"among_{size - n}" + ("_dense_dispatch" if dense else "")
        outcome.outputs.append(cmp.variants_agree(name, got, alone))
    return outcome


def _experts_sample(name, **params):
    return Sample(name, params={"batches": ((64, False), (64, True), (1040, False)), "probes": 8, **params})


register(Case(
    "variants.moe.experts", "variants", "moe.experts", run=_moe_experts, dtypes=DTYPES, smoke_dtype="bfloat16",
    samples=(
        _experts_sample("E16_k4_L256_I128_mxfp4", experts=16, top_k=4, latent=256, inter=128),
        _experts_sample("E32_k4_L1024_I512_mxfp4", experts=32, top_k=4, latent=1024, inter=512),
    ),
    doc="MXFP4 routed experts: tokens alone, in a decode batch (both dispatches) and in a prefill "
        "chunk agree at the rounding points."))


def _router_logits(ctx, item):
    p, dtype = item.sample.params, TORCH_DTYPES[item.dtype]
    g = torch.Generator().manual_seed(item.seed)
    d, e, n = p["hidden"], p["experts"], 3
    h, weight = randn(g, (n, d), dtype), randn(g, (e, d), dtype, d ** -0.5)
    logits = ctx.platform.kernels.moe.router_logits
    alone = torch.cat([_call(ctx, logits, h[r: r + 1], weight) for r in range(n)])
    outcome = cmp.Outcome([cmp.close("alone_vs_oracle", alone, ref.router_logits(h.double(), weight.double()),
                                     item.case.tolerance(item.dtype))])
    for size in (n, 64):
        rows = torch.randperm(size, generator=g)[:n]
        hb = _embed(rows, h, randn(g, (size - n, d), dtype))
        outcome.outputs.append(cmp.variants_agree(f"in_{size}", _call(ctx, logits, hb, weight)[rows], alone))
    return outcome


register(Case(
    "variants.moe.router_logits", "variants", "moe.router_logits", run=_router_logits, dtypes=DTYPES,
    smoke_dtype="bfloat16",
    samples=(Sample("D7168_E128", params={"hidden": 7168, "experts": 128}),),
    doc="fp32 router logits of rows alone, in a batch of 3 and of 64 agree to fp32 accumulation order."))


# ------------------------------------------------------------------------------------ MLA
def _mla_decode(ctx, item):
    p, dtype = item.sample.params, TORCH_DTYPES[item.dtype]
    g = torch.Generator().manual_seed(item.seed)
    dims = {key: p[key] for key in ("h", "r", "dn", "dr", "dv", "page_size")}
    page_dtype = getattr(torch, p["pages"]) if p.get("pages") else None
    lens = torch.randint(p["min_len"], p["max_len"] + 1, (p["batch"],), generator=g).tolist()
    inp = decode_inputs(g, dtype, seq_lens=lens, q_lens=[1] * len(lens), page_dtype=page_dtype,
                        kv_scale=p.get("kv_scale"), **dims)
    q_nope, q_pe, pages, table, seq_lens, w_uk, w_uv = inp.args
    q_nope, q_pe = q_nope * p["query_scale"], q_pe * p["query_scale"]         # peaked attention, as trained models
    kw = {key: v for key, v in inp.kwargs.items() if key != "cu_seqlens_q"}
    decode = ctx.platform.kernels.mla.decode
    probes = p["probes"]

    def one(n):
        return _call(ctx, decode, q_nope[n: n + 1], q_pe[n: n + 1], pages, table[n: n + 1], seq_lens[n: n + 1],
                     w_uk, w_uv, **kw)

    alone = torch.cat([one(n) for n in range(probes)])                          # [P, H, Dv]
    oracle = ref.mla_decode(q_nope[:probes].double(), q_pe[:probes].double(), pages if pages.dtype != dtype
                            else pages.double(), table[:probes], seq_lens[:probes], w_uk.double(), w_uv.double(),
                            **{key: v for key, v in kw.items()})
    outcome = cmp.Outcome([cmp.close("alone_vs_oracle", alone, oracle, item.case.tolerance(item.dtype))])
    batch = _call(ctx, decode, q_nope, q_pe, pages, table, seq_lens, w_uk, w_uv, **kw)[:probes]
    outcome.outputs.append(cmp.variants_agree(f"in_a_batch_of_{len(lens)}", batch, alone))
    # the probes as the last of 3 verify queries each (two earlier queries of the same sequences)
    early = randn(g, (probes, 2, *q_nope.shape[1:]), dtype) * p["query_scale"]
    early_pe = randn(g, (probes, 2, *q_pe.shape[1:]), dtype) * p["query_scale"]
    qv = torch.cat([early, q_nope[:probes, None]], 1).flatten(0, 1)
    qv_pe = torch.cat([early_pe, q_pe[:probes, None]], 1).flatten(0, 1)
    cu = torch.arange(0, 3 * probes + 1, 3, dtype=torch.int32)
    verify = _call(ctx, decode, qv, qv_pe, pages, table[:probes], seq_lens[:probes], w_uk, w_uv,
                   cu_seqlens_q=cu, **kw)[2::3]
    outcome.outputs.append(cmp.variants_agree("last_of_3_verify_queries", verify, alone))
    # a DSA selection of every position (the sparse path), in a shuffled order
    width = max(seq_lens[:probes].tolist())
    topk = torch.full((probes, width), -1, dtype=torch.int32)
    for n in range(probes):
        topk[n, : int(seq_lens[n])] = torch.randperm(int(seq_lens[n]), generator=g).to(torch.int32)
    sparse = _call(ctx, decode, q_nope[:probes], q_pe[:probes], pages, table[:probes], seq_lens[:probes], w_uk, w_uv,
                   topk_indices=topk, **kw)
    outcome.outputs.append(cmp.variants_agree("selection_of_every_position", sparse, alone))
    return outcome


def _mla_sample(name, **params):
    base = {"batch": 64, "probes": 6, "min_len": 40, "max_len": 300, "page_size": 16, "query_scale": 2.0}
    return Sample(name, params={**base, **params})


register(Case(
    "variants.mla.decode", "variants", "mla.decode", run=_mla_decode, dtypes=DTYPES, smoke_dtype="bfloat16",
    samples=(
        _mla_sample("H4_R64_Dn16_Dr16_Dv16", h=4, r=64, dn=16, dr=16, dv=16, min_len=20, max_len=100),
        _mla_sample("H16_R512_Dn128_Dr64_Dv128_real_head_dims", h=16, r=512, dn=128, dr=64, dv=128),
        _mla_sample("H16_R512_fp8_pages", h=16, r=512, dn=128, dr=64, dv=128, pages="float8_e4m3fn", kv_scale=0.05),
    ),
    doc="Absorbed MLA decode: a query alone, in a 64-sequence batch, in a verify step and through a "
        "full DSA selection agree at the rounding points."))
