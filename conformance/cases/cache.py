"""Cache views: the kernels reading and writing paged caches and state rows as the model
drives them.

- MLA decode over fp8 latent pages (the platform's fp8 flavour) with a per-tensor scale, a
  shuffled block table and NaN-poisoned pages outside the valid range.
- MLA decode over NVFP4 latent records (`k3.quant.nvfp4_latent`): rows stored with the
  platform's NVFP4 / FP8 codecs into 0xFF-poisoned record pages, read back dequantised
  (`k3.model.latent_store`) by the platform's mla.decode.
- DSA index keys in fp8 and MXFP4 pages (`IndexKeyCacheView`), through the model's
  `DSAIndexer`: prefill, chunked continuation and decode over poisoned, shuffled pages.
- KDA state rows addressed by `state_indices` (`KDAStateView`), through the model's
  `KDAMixer`: fresh rows (poisoned, zeroed by the layer), chunked prefill, decode, verify with
  per-position states; rows no sequence uses must stay poisoned.

The layer cases run the layer with the platform's kernels in the item's dtype against the
same layer with the reference kernels in float64 (same weights, same inputs).
"""

from __future__ import annotations

import dataclasses

import torch

from k3 import reference as ref
from k3.config import K3Config
from k3.model import contiguous_block_table, reference_kernels
from k3.model.indexer import DSAIndexer
from k3.model.kda import KDAMixer
from k3.model.paging import token_page_slots
from k3.model.parallel import ParallelContext
from k3.model.latent_store import readable_latents, store_latents
from k3.model.metadata import CacheViews, ForwardMetadata, IndexKeyCacheView, KDAStateView, LatentCacheView
from k3.quant.nvfp4_latent import nvfp4_latent_record_bytes

from .. import compare as cmp
from ..inputs import TORCH_DTYPES, poison_freed_memory, poisoned, randn, shuffled_pages, state_dtype, synchronize
from ..layers import Capture, twin_layers
from ..registry import Case, Sample, register, tolerances
from ..runner import run_kernel_item
from .mla import SMALL, decode_inputs

FP8_DTYPES = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}


def _mla_fp8_pages(ctx, item):
    fp8 = FP8_DTYPES[ctx.platform.capabilities.fp8_dtype]
    inputs = decode_inputs(torch.Generator().manual_seed(item.seed), TORCH_DTYPES[item.dtype], page_dtype=fp8,
                           kv_scale=0.05, **item.sample.params)
    return run_kernel_item(ctx, item, inputs)


register(Case(
    "cache.mla_decode_fp8_pages", "cache", "mla.decode", reference=ref.mla_decode, requires=("fp8",),
    run=_mla_fp8_pages, outputs=lambda o, a, k: {"o": o},
    samples=(
        Sample("N3_ps16_lens7-40-16_scale0.05_shuffled_poisoned", params=dict(seq_lens=(7, 40, 16), page_size=16,
                                                                              **SMALL)),
        Sample("verify_q2-1-4_N3_ps16_lens9-21-33", params=dict(seq_lens=(9, 21, 33), q_lens=(2, 1, 4),
                                                                page_size=16, **SMALL)),
        Sample("dsa_topk8_N2_ps16_lens30-12", params=dict(seq_lens=(30, 12), page_size=16, topk=8, **SMALL)),
        Sample("real_dims_N2_ps64_lens70-130_H2_R512_Dr64",
               params=dict(seq_lens=(70, 130), page_size=64, h=2, r=512, dn=128, dr=64, dv=128)),
    ),
    doc="Absorbed MLA decode over fp8 latent pages with a per-tensor scale."))


def _mla_nvfp4_pages(ctx, item):
    """Store every valid row of a poisoned, shuffled decode input as NVFP4 records with the
    platform's codecs, read them back with its kernels, and compare: the decoded records with
    the reference codec's decoding of the same rows, the untouched slots (still 0xFF), and the
    platform's mla.decode over them with the float64 oracle over the reference's records."""
    p, dtype, dev = item.sample.params, TORCH_DTYPES[item.dtype], ctx.device
    tol, kernels, r, gs = item.case.tolerance(item.dtype), ctx.platform.kernels, p["r"], p["global_scale"]
    spec = {k: v for k, v in p.items() if k != "global_scale"}
    inputs = decode_inputs(torch.Generator().manual_seed(item.seed), dtype, **spec)
    q_nope, q_pe, rows, table, seq_lens, w_uk, w_uv = inputs.args
    written = torch.isfinite(rows.float()).all(-1)                           # [P, page]: the valid slots
    at = written.nonzero(as_tuple=True)
    records = poisoned((*rows.shape[:2], nvfp4_latent_record_bytes(r, rows.shape[2] - r)), torch.uint8)
    view = LatentCacheView(records.to(dev), torch.tensor(gs, device=dev), fmt="nvfp4", kv_lora_rank=r)
    poison_freed_memory(dev)
    store_latents(kernels, view, tuple(a.to(dev) for a in at), rows[at].to(dev))
    pages, _, dense_table = readable_latents(kernels, view, table.to(dev), dtype)
    o = kernels.mla.decode(q_nope.to(dev), q_pe.to(dev), pages, dense_table, seq_lens.to(dev), w_uk.to(dev),
                           w_uv.to(dev), **{k: v.to(dev) if isinstance(v, torch.Tensor) else v
                                            for k, v in inputs.kwargs.items()})
    synchronize(dev)
    stored = view.pages.cpu()
    want_rows = ref.nvfp4_latent_dequantize(ref.nvfp4_latent_quantize(rows[at].double(), kv_lora_rank=r,
                                                                      global_scale=gs),
                                            kv_lora_rank=r, global_scale=gs, dtype=torch.float64)
    ref_pages = poisoned(rows.shape, torch.float64)
    ref_pages[at] = want_rows
    want = ref.mla_decode(q_nope.double(), q_pe.double(), ref_pages, table, seq_lens, w_uk.double(), w_uv.double(),
                          **{k: v for k, v in inputs.kwargs.items()})
    outcome = cmp.Outcome()
    got_rows = ref.nvfp4_latent_dequantize(stored[at], kv_lora_rank=r, global_scale=gs, dtype=torch.float64)
    outcome.outputs.append(cmp.close("stored_rows", got_rows, want_rows, tol))
    outcome.outputs.append(cmp.exact("untouched_slots", stored[~written], torch.full_like(stored[~written], 255)))
    outcome.outputs.append(cmp.close("o", o.cpu(), want, tol))
    return outcome


register(Case(
    "cache.mla_decode_nvfp4_pages", "cache", "mla.decode", run=_mla_nvfp4_pages, dtypes=("float32", "bfloat16"),
    samples=(
        Sample("N3_ps16_lens7-40-16_gs1_shuffled_poisoned",
               params=dict(seq_lens=(7, 40, 16), page_size=16, global_scale=1.0, **SMALL)),
        Sample("dsa_topk8_N2_ps16_lens30-12_gs0.25", params=dict(seq_lens=(30, 12), page_size=16, topk=8,
                                                                  global_scale=0.25, **SMALL)),
    ),
    doc="Absorbed MLA decode over NVFP4 latent records: quantise on store, dequantise on read."))


def _steps(seq_slots, steps):
    """Per step: (sequence indices, their new token counts); sequences keep their slots."""
    for step in steps:
        seqs = [s for s, _ in step]
        yield seqs, [n for _, n in step], [seq_slots[s] for s in seqs]


def on_device(meta: ForwardMetadata, device) -> ForwardMetadata:
    """The same metadata with every tensor on `device`."""
    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
                                        if isinstance(getattr(meta, f.name), torch.Tensor)})


# ------------------------------------------------------------------------- KDA state rows

def _kda_rows(ctx, item):
    p, dtype = item.sample.params, TORCH_DTYPES[item.dtype]
    cfg = K3Config.preset(p["preset"])
    if "head_dim" in p:
        cfg = cfg.replace(linear_attn=dataclasses.replace(cfg.linear_attn, head_dim=p["head_dim"],
                                                          num_heads=p["heads"]))
    la, sd, dev, tol = cfg.linear_attn, state_dtype(dtype), ctx.device, item.case.tolerance(item.dtype)

    def build(cfg, *, kernels, dtype, device):
        return KDAMixer(cfg, kda_index=0, kernels=kernels, parallel=ParallelContext(), dtype=dtype, device=device)

    layer, oracle = twin_layers(build, cfg, kernels=ctx.platform.kernels, dtype=dtype, device=dev, seed=item.seed,
                                prefix="model.layers.0.self_attn.")
    rows, hk, w = p["rows"], la.num_heads * la.head_dim, la.short_conv_kernel_size
    rec = (rows, la.num_heads, la.head_dim, la.head_dim)
    view = KDAStateView(poisoned(rec, sd).to(dev), poisoned((rows, 3 * hk, w - 1), dtype).to(dev))
    ref_view = KDAStateView(poisoned(rec, torch.float64), poisoned((rows, 3 * hk, w - 1), torch.float64))
    g, context = torch.Generator().manual_seed(item.seed), [0] * len(p["slots"])
    outcome = cmp.Outcome()
    for i, (seqs, lens, slots) in enumerate(_steps(p["slots"], p["steps"])):
        per_position = i in p.get("per_position_steps", ())
        x = randn(g, (sum(lens), cfg.hidden_size), dtype)
        meta = ForwardMetadata.build([[0] * n for n in lens], context_lens=[context[s] for s in seqs],
                                     state_indices=slots, block_table=contiguous_block_table(len(seqs), 8),
                                     page_size=16)
        dev_meta = on_device(meta, dev)
        poison_freed_memory(dev)
        with torch.no_grad():
            out, states = layer(x.to(dev), dev_meta, CacheViews([view], [], None), per_position_states=per_position)
            want, want_states = oracle(x.double(), meta, CacheViews([ref_view], [], None),
                                       per_position_states=per_position)
        tag = f"step{i}"
        outcome.outputs.append(cmp.close(f"{tag}.out", out.cpu(), want, tol))
        if per_position:
            outcome.outputs.append(cmp.close(f"{tag}.per_position_states", states.cpu(), want_states, tol))
        # every row: used rows updated, rows no sequence owns still poisoned
        outcome.outputs.append(cmp.close(f"{tag}.recurrent_rows", view.recurrent.cpu(), ref_view.recurrent, tol))
        outcome.outputs.append(cmp.close(f"{tag}.conv_rows", view.conv.cpu(), ref_view.conv, tol))
        for s, n in zip(seqs, lens):
            context[s] += n
    return outcome


# steps: (sequence, new tokens); sequence 3 joins late in a row nobody used before
KDA_STEPS = ([(0, 9), (1, 20), (2, 3)],          # prefill, fresh rows
             [(0, 5), (1, 1), (2, 7), (3, 4)],   # chunked continuation + a fresh sequence
             [(0, 1), (1, 1), (2, 1), (3, 1)],   # decode
             [(0, 1), (1, 3), (3, 2)])           # verify with per-position states
KDA_ROWS = {"rows": 7, "slots": (4, 1, 3, 6), "steps": KDA_STEPS, "per_position_steps": (3,)}
LAYER_TOL = tolerances(float32=(2e-3, 1e-5), bfloat16=(5e-2, 1e-3))

register(Case(
    "cache.kda_state_rows", "cache", "kda.chunked", run=_kda_rows, tolerances=LAYER_TOL,
    samples=(
        Sample("k3_H4_K16_rows7_slots4-1-3-6_prefill_chunk_decode_verify", params={"preset": "k3-tiny", **KDA_ROWS}),
        Sample("kimi_linear_H4_K16_softplus_gate", params={"preset": "kimi-linear-tiny", **KDA_ROWS}),
        Sample("k3_H2_K128_real_head_dim", params={"preset": "k3-tiny", "heads": 2, "head_dim": 128, **KDA_ROWS}),
    ),
    doc="KDA layer over state rows addressed by state_indices (conv and recurrent rows)."))


# ------------------------------------------------------------------------- DSA index keys

def _index_key_view(fmt, pages, page_size, d):
    if fmt == "fp8":
        return IndexKeyCacheView(poisoned((pages, page_size, d), torch.float8_e4m3fn),
                                 poisoned((pages, page_size), torch.float32), fmt)
    return IndexKeyCacheView(poisoned((pages, page_size, d // 2), torch.uint8),
                             poisoned((pages, page_size, d // 32), torch.uint8), fmt)


def _decoded_pages(view: IndexKeyCacheView) -> torch.Tensor:
    p, s = view.values.shape[:2]
    scales = view.scales.cpu().reshape(p * s, *view.scales.shape[2:])
    return ref.indexer_dequantize_keys(view.values.cpu().reshape(p * s, -1), scales, fmt=view.fmt,
                                       dtype=torch.float64)


def _index_keys(ctx, item):
    p, dtype = item.sample.params, TORCH_DTYPES[item.dtype]
    cfg = K3Config.preset("k3.1-pro-tiny")
    if "head_dim" in p:
        cfg = cfg.replace(index_head_dim=p["head_dim"], index_n_heads=p["heads"])
    dev, tol, fmt, ps = ctx.device, item.case.tolerance(item.dtype), p["fmt"], p["page_size"]
    entries = ["indexer.scores", "indexer.decode_scores", "indexer.paged_decode_scores"]
    mine, theirs = Capture(), Capture()

    def build(cfg, *, kernels, dtype, device):
        return DSAIndexer(cfg, kernels=kernels, dtype=dtype, device=device)

    layer, oracle = twin_layers(build, cfg, kernels=mine.wrap(ctx.platform.kernels, entries), dtype=dtype,
                                device=dev, seed=item.seed, prefix="model.layers.3.self_attn.indexer.",
                                oracle_kernels=theirs.wrap(reference_kernels(), entries))
    g = torch.Generator().manual_seed(item.seed)
    n_seqs = 1 + max(s for step in p["steps"] for s, _ in step)
    totals = [sum(n for step in p["steps"] for s, n in step if s == seq) for seq in range(n_seqs)]
    table, pages, _ = shuffled_pages(g, totals, ps)
    d = cfg.index_head_dim
    view, ref_view = _index_key_view(fmt, pages, ps, d), _index_key_view(fmt, pages, ps, d)
    view = IndexKeyCacheView(view.values.to(dev), view.scales.to(dev), fmt)
    context, outcome = [0] * len(totals), cmp.Outcome()
    for i, (seqs, lens, _) in enumerate(_steps(list(range(len(totals))), p["steps"])):
        x = randn(g, (sum(lens), cfg.hidden_size), dtype)
        c_q = randn(g, (sum(lens), cfg.q_lora_rank), dtype)
        meta = ForwardMetadata.build([[0] * n for n in lens], context_lens=[context[s] for s in seqs],
                                     state_indices=seqs, block_table=table[seqs], page_size=ps)
        dev_meta = on_device(meta, dev)
        poison_freed_memory(dev)
        with torch.no_grad():
            got = layer(x.to(dev), c_q.to(dev), dev_meta, view, *token_page_slots(dev_meta, ps))
            want = oracle(x.double(), c_q.double(), meta, ref_view, *token_page_slots(meta, ps))
        scores, ref_scores = mine.seen[mine.last].cpu(), theirs.seen[theirs.last]
        tag = f"step{i}.{theirs.last.split('.')[1]}"
        outcome.outputs.append(cmp.close(f"{tag}", scores, ref_scores, tol))
        finite = ref_scores[torch.isfinite(ref_scores)]
        tie = 4 * tol.ratio * finite.pow(2).mean().sqrt().item() if finite.numel() else 0.0
        outcome.outputs.append(cmp.topk_sets(f"step{i}.topk", got.cpu(), want, ref_scores, tie_tol=tie))
        outcome.outputs.append(cmp.close(f"step{i}.key_pages", _decoded_pages(view), _decoded_pages(ref_view), tol))
        for s, n in zip(seqs, lens):
            context[s] += n
    return outcome


DSA_STEPS = ([(0, 20), (1, 33), (2, 9)],   # prefill (contexts past top-16)
             [(0, 1), (1, 1), (2, 1)],     # decode: padded page reads, decode scores
             [(0, 4), (1, 1), (2, 6)])     # chunked continuation
DSA_TOL = tolerances(float32=(2e-3, 1e-5), bfloat16=(5e-2, 1e-3))

register(Case(
    "cache.index_key_pages", "cache", "indexer.dequantize_keys", run=_index_keys, tolerances=DSA_TOL,
    samples=(
        Sample("fp8_ps16_Hi4_D32_prefill_decode_chunk", params={"fmt": "fp8", "page_size": 16, "head_dim": 32,
                                                                "heads": 4, "steps": DSA_STEPS}, requires=("fp8",)),
        Sample("mxfp4_ps16_Hi4_D32_prefill_decode_chunk", params={"fmt": "mxfp4", "page_size": 16, "head_dim": 32,
                                                                  "heads": 4, "steps": DSA_STEPS}),
        Sample("fp8_ps64_Hi8_D128_real_head_dim", params={"fmt": "fp8", "page_size": 64, "head_dim": 128, "heads": 8,
                                                          "steps": DSA_STEPS}, requires=("fp8",)),
    ),
    doc="DSA indexer over fp8 / MXFP4 index-key pages: writes, padded reads, scores, top-k."))
