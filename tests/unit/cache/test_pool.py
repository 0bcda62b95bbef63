"""Block pool accounting and the packed backing tensor's per-layer views."""

import pytest
import torch

from k3.cache.block_pool import BlockPool
from k3.cache.format import CacheFormat
from k3.cache.pool import CachePool
from k3.config import K3Config
from k3.dtypes import torch_dtype
from k3.quant.mxfp4 import mxfp4_dequantize, mxfp4_quantize
from k3.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize


def test_block_pool_refcounts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1 and pool.allocate(2) is None and pool.num_free == 1
    pool.incref([1])
    pool.free(a)
    assert pool.num_free == 3                  # row 1 still shared
    pool.free([1])
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([1])
    with pytest.raises(ValueError, match="no rows"):
        BlockPool(0)


def _pool(preset, rows=5, act="float64", kv="fp64"):
    cfg = K3Config.preset(preset)
    return CachePool(cfg, CacheFormat.build(cfg, activation_dtype=torch_dtype(act), kv_cache_dtype=kv), rows)


def _state_views(views):
    return [t for v in views.kda for t in (v.recurrent, v.conv)]


def _attention_views(views):
    out = [v.pages for v in views.latent]
    for v in views.index_keys or []:
        out += [v.values, v.scales]
    return out


def _all_views(views):
    return _state_views(views) + _attention_views(views)


@pytest.mark.parametrize("preset", ["k3-tiny", "k3.1-pro-tiny", "kimi-linear-tiny"])
def test_views_tile_rows_without_overlap(preset):
    """A row is either an attention row or a state row: within each use, the layers' regions
    are disjoint, and they live in the pool's backing storage."""
    pool = _pool(preset)
    assert all(torch.isnan(v.float()).all() for v in _all_views(pool.views))   # poisoned until written
    for views in (_state_views(pool.views), _attention_views(pool.views)):
        for i, v in enumerate(views):
            assert v.shape[0] == pool.num_rows
            assert v.untyped_storage().data_ptr() == pool.backing.untyped_storage().data_ptr()
            v.view(torch.uint8).fill_(i + 1)
        for i, v in enumerate(views):
            assert (v.view(torch.uint8) == i + 1).all(), i        # no other region overwrote it


def test_copy_row_moves_every_layer():
    pool = _pool("k3.1-pro-tiny", rows=3)
    g = torch.Generator().manual_seed(0)
    for v in _all_views(pool.views):
        v[1].copy_(torch.randn(v[1].shape, generator=g).to(v.dtype))
    pool.copy_row(1, 2)
    for v in _all_views(pool.views):
        assert torch.equal(v[2].view(torch.uint8), v[1].view(torch.uint8))


def test_fp4_records_round_trip_through_the_pool_views():
    """nvfp4 latents and mxfp4 index keys: a token's record written through the views decodes
    as the codecs of its values do (`k3.quant`), and no other token's bytes change."""
    from k3.model import reference_kernels
    from k3.model.latent_store import decode_latent_rows, store_latents

    cfg = K3Config.preset("k3.1-pro-tiny")
    pool = CachePool(cfg, CacheFormat.build(cfg, activation_dtype=torch.float32, kv_cache_dtype="nvfp4",
                                            index_cache_dtype="mxfp4", block_size=16), 3)
    before = pool.backing.clone()
    lat, keys = pool.views.latent[0], pool.views.index_keys[0]
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(2, cfg.mla_latent_size, generator=g)
    at = (torch.tensor([2, 0]), torch.tensor([5, 15]))
    store_latents(reference_kernels(), lat, at, rows)
    r = cfg.kv_lora_rank
    c = nvfp4_dequantize(*nvfp4_quantize(rows[:, :r], global_scale=1.0))
    pe = rows[:, r:].to(torch.float8_e4m3fn).float()
    decoded = decode_latent_rows(reference_kernels(), lat, lat.pages[at], torch.float32)
    assert torch.equal(decoded, torch.cat([c, pe], -1))
    k = torch.randn(2, cfg.index_head_dim, generator=g)
    packed, scales = mxfp4_quantize(k)
    keys.values[at], keys.scales[at] = packed, scales
    assert torch.equal(mxfp4_dequantize(keys.values[at], keys.scales[at]), mxfp4_dequantize(packed, scales))
    changed = (pool.backing != before).nonzero()[:, 0].unique().tolist()
    assert changed == [0, 2]                                  # only the two rows written
    assert torch.isnan(decode_latent_rows(reference_kernels(), lat, lat.pages[1, :1], torch.float32)).all()


def test_kernel_page_addresses_reach_the_same_tokens():
    """Reading a layer's latents through translated kernel pages (64-token pages inside
    256-token rows) gives exactly what reading through the rows gives."""
    from k3.cache.pool import kernel_page_offsets, kernel_page_table

    cfg = K3Config.preset("k3-tiny")
    pool = CachePool(cfg, CacheFormat.build(cfg, activation_dtype=torch.float32, block_size=256), 6)
    pages = pool.views.latent[1].pages                                   # [6, 256, 40]
    pages.copy_(torch.randn(pages.shape, generator=torch.Generator().manual_seed(0)))
    table = torch.tensor([[4, 1, 3], [0, 5, 2]])
    kernel = kernel_page_table(table, block_size=256, kernel_page=64)   # [2, 12]
    assert kernel.shape == (2, 12) and kernel[0, :4].tolist() == [16, 17, 18, 19]
    storage = torch.tensor([], dtype=torch.float32).set_(pages.untyped_storage())   # the backing storage as floats
    offsets = kernel_page_offsets(pages, kernel, kernel_page=64)
    for n in range(2):
        for i in range(12):
            start = int(offsets[n, i])
            got = torch.stack([storage[start + t * pages.stride(1): start + t * pages.stride(1) + 40] for t in range(64)])
            row, first = table[n, i // 4], (i % 4) * 64
            assert torch.equal(got, pages[row, first:first + 64])
    with pytest.raises(ValueError, match="divide"):
        kernel_page_table(table, block_size=256, kernel_page=96)


def test_records_of_the_recover_rollback_live_beside_the_rows():
    """`allocate_records`: per KDA layer, slots x tokens keys, decays, corrections (the state
    dtype, this rank's heads) and pre-conv inputs (the activation dtype), NaN-poisoned."""
    pool = _pool("k3-tiny", rows=3)
    pool.allocate_records(slots=2, tokens=4)
    cfg = pool.cfg
    la = cfg.linear_attn
    assert len(pool.views.kda_records) == len(cfg.kda_layer_ids)
    rec = pool.views.kda_records[0]
    assert rec.keys.shape == (2, 4, la.num_heads, la.head_dim) and rec.keys.dtype == torch.float64
    assert rec.qkv.shape == (2, 4, 3 * la.num_heads * la.head_dim) and torch.isnan(rec.corrections).all()


@pytest.mark.parametrize("preset", ["k3-tiny", "k3.1-pro-tiny"])
def test_typed_regions_hold_what_the_packed_views_hold(preset):
    """`typed_regions` (a device that cannot write through byte views, XLA): every region is a
    tensor of its own dtype with the views' shapes, poisoned alike, and a row copy moves every
    region, as one copy of a packed row does. (Packed regions overlap, attention and state rows
    being one row space; typed ones do not.)"""
    cfg = K3Config.preset(preset)
    fmt = CacheFormat.build(cfg, activation_dtype=torch.float32, kv_cache_dtype="bf16", index_cache_dtype="fp8")
    packed, typed = CachePool(cfg, fmt, 4), CachePool(cfg, fmt, 4, typed_regions=True)
    assert typed.backing is None

    def tensors(views):
        out = [t for v in views.kda for t in (v.recurrent, v.conv)] + [v.pages for v in views.latent]
        return out + [t for v in (views.index_keys or []) for t in (v.values, v.scales)]

    pairs = list(zip(tensors(packed.views), tensors(typed.views), strict=True))
    g = torch.Generator().manual_seed(0)
    for p, t in pairs:
        assert (p.shape, p.dtype) == (t.shape, t.dtype) and t.data_ptr() != p.data_ptr()
        assert bool((t.contiguous().view(torch.uint8) == 0xFF).all())        # poisoned as a fresh backing
        fresh = torch.randn(p.shape, generator=g).to(p.dtype)
        p.copy_(fresh)
        t.copy_(fresh)
    packed.copy_row(1, 3)
    typed.copy_row(1, 3)
    for p, t in pairs:
        assert torch.equal(t[3], t[1]) and torch.equal(p[3], p[1])     # (packed regions overlap: a row is one kind)
