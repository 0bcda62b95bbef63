"""The transfer plan of prefill/decode disaggregation under tensor parallelism
(k3.engine.kv_transfer.plan), run on in-process caches: for every pair of TP sizes (1, 2, 4)
the reads put into each consumer rank's views exactly its heads of the KDA state (recurrent
state and the q, k, v conv windows) and the replicated attention records, byte for byte; equal
sizes read whole rows rank to rank; formats that differ beyond the heads' split are refused."""

import dataclasses

import pytest
import torch

from k3.cache.format import CacheFormat
from k3.cache.pool import CachePool
from k3.config import K3Config
from k3.engine.kv_transfer.backend import Registrations
from k3.engine.kv_transfer.handle import TransferHandle, layout_at_tp, layout_digest
from k3.engine.kv_transfer.plan import rank_reads, state_segments

ROWS, BLOCK = 4, 16


def _pools(cfg, tp: int, dtype=torch.float64, **fmt) -> list[CachePool]:
    f = CacheFormat.build(cfg, activation_dtype=dtype, tensor_parallel_size=tp, block_size=BLOCK, **fmt)
    return [CachePool(cfg, f, ROWS) for _ in range(tp)]


def _fill_producer(pools: list[CachePool], cfg, g: torch.Generator):
    """Random bytes everywhere; the attention rows equal on every rank (replicated records), and
    state row 3 holding each rank's heads of one global state per KDA layer."""
    la, tp = cfg.linear_attn, len(pools)
    shared = torch.randint(0, 256, pools[0].backing.shape, generator=g, dtype=torch.uint8)
    for pool in pools:
        pool.backing.copy_(shared)
    h, d, w = la.num_heads, la.head_dim, la.short_conv_kernel_size - 1
    full = []
    for layer, _ in enumerate(cfg.kda_layer_ids):
        rec = torch.randn(h, d, d, generator=g, dtype=torch.float64)
        conv = torch.randn(3, h, d, w, generator=g, dtype=torch.float64)       # [q | k | v][heads][head dim]
        full.append((rec, conv))
        hs = h // tp
        for p, pool in enumerate(pools):
            view = pool.views.kda[layer]
            view.recurrent[3] = rec[p * hs:(p + 1) * hs].to(view.recurrent.dtype)
            view.conv[3] = conv[:, p * hs:(p + 1) * hs].reshape(3 * hs * d, w).to(view.conv.dtype)
    return full


def _handle(pools: list[CachePool], rows=(0, 1, 2), state_row=3) -> TransferHandle:
    ranks = tuple((f"producer-{p}", pool.backing.data_ptr()) for p, pool in enumerate(pools))
    return TransferHandle(transfer_id="t", remote_engine_id="p", remote_control="c", remote_data=ranks[0][0],
                          remote_base=ranks[0][1], row_bytes=pools[0].layout.row_bytes, block_size=BLOCK,
                          layout_digest=layout_digest(pools[0]), num_tokens=40, prompt_digest="x", rows=rows,
                          state_row=state_row, first_token=1, first_logprob=0.0,
                          ranks=ranks if len(pools) > 1 else ())


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 1), (2, 2), (2, 1), (1, 2), (4, 2), (2, 4), (1, 4), (4, 1)])
def test_reads_give_each_rank_its_heads(src_tp, dst_tp):
    cfg = K3Config.preset("k3-tiny")
    g = torch.Generator().manual_seed(10 * src_tp + dst_tp)
    producers, consumers = _pools(cfg, src_tp), _pools(cfg, dst_tp)
    full = _fill_producer(producers, cfg, g)
    handle = _handle(producers)
    source, digest = layout_at_tp(consumers[0], src_tp)
    assert digest == handle.layout_digest and source == producers[0].layout
    regs = Registrations()
    for pool in producers + consumers:
        regs.add(pool.backing)
    pairs = [(0, 2), (1, 0), (2, 3), (3, 1)]                  # (producer row, consumer row); the last: state
    h, d = cfg.linear_attn.num_heads, cfg.linear_attn.head_dim
    for c, pool in enumerate(consumers):
        reads = rank_reads(handle, source, pool.layout, heads=h, dst_tp=dst_tp, dst_rank=c,
                           dst_base=pool.backing.data_ptr(), pairs=pairs)
        if src_tp == dst_tp:                                   # whole rows, from the same rank
            assert [(r.peer, r.nbytes) for r in reads] == [(f"producer-{c}", pool.layout.row_bytes)] * len(pairs)
        for r in reads:
            regs.view(r.local, r.nbytes).copy_(regs.view(r.remote, r.nbytes))
        att_end = max(x.offset + x.nbytes for x in pool.layout.attention_regions)
        for remote, local in pairs[:-1]:
            assert torch.equal(pool.backing[local, :att_end], producers[0].backing[remote, :att_end])
        hc = h // dst_tp
        for layer, (rec, conv) in enumerate(full):
            view = pool.views.kda[layer]
            assert torch.equal(view.recurrent[1], rec[c * hc:(c + 1) * hc].to(view.recurrent.dtype))
            assert torch.equal(view.conv[1], conv[:, c * hc:(c + 1) * hc].reshape(3 * hc * d, -1).to(view.conv.dtype))


def test_segments_cover_the_state_regions_once():
    """Re-sharded, every byte of a consumer rank's KDA regions is written exactly once."""
    cfg = K3Config.preset("kimi-linear-tiny")
    src, dst = _pools(cfg, 4, torch.bfloat16)[0].layout, _pools(cfg, 1, torch.bfloat16)[0].layout
    segments = state_segments(src, dst, heads=4, src_tp=4, dst_tp=1, dst_rank=0)
    covered = torch.zeros(dst.row_bytes, dtype=torch.int32)
    for s in segments:
        covered[s.dst_offset: s.dst_offset + s.nbytes] += 1
    for region in dst.state_regions:
        assert (covered[region.offset: region.offset + region.nbytes] == 1).all(), region.name
    assert covered.sum() == dst.state_bytes
    assert {s.src_rank for s in segments} == {0, 1, 2, 3}
    assert len(segments) == len(cfg.kda_layer_ids) * 4 * (1 + 3)       # per layer and producer rank: 1 + q, k, v


def test_other_formats_differ_beyond_the_heads():
    cfg = K3Config.preset("k3-tiny")
    mine = _pools(cfg, 1)[0]
    for other in (_pools(cfg, 2, kv_cache_dtype="fp32")[0],                 # another latent format
                  _pools(cfg, 2, index_cache_dtype="mxfp4")[0]):
        assert layout_at_tp(mine, 2)[1] != layout_digest(other)
    assert layout_at_tp(mine, 2)[1] == layout_digest(_pools(cfg, 2)[0])
    shifted = dataclasses.replace(mine.format, kda_state_layout="hvk", tensor_parallel_size=2)
    assert layout_at_tp(mine, 2)[1] != layout_digest(CachePool(cfg, shifted, 1))
