"""The backing tensor of one rank's cache and the per-layer views kernels read and write.

Rows are `row_bytes` apart in one uint8 tensor; each layer's pages are a strided view into
every row (row id = page id = state index), so moving a block is one row copy and kernels
never see the row format. Fresh rows are poisoned (0xFF bytes: NaN in every float format
used) so reads of unwritten memory show.
"""

from __future__ import annotations

import torch

from k3.config import K3Config
from k3.dtypes import LATENT_DTYPES
from k3.quant.mxfp4 import MXFP4_BLOCK
from k3.quant.nvfp4 import NVFP4_BLOCK
from k3.quant.nvfp4_latent import nvfp4_latent_record_bytes
from k3.model.metadata import CacheViews, IndexKeyCacheView, KDARecordView, KDAStateView, LatentCacheView

from .format import CacheFormat


def _view(backing: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Region [offset, offset + nbytes) of every row as a [num_rows, *shape] tensor of dtype."""
    region = backing[:, offset: offset + nbytes]                       # [rows, nbytes] uint8, row-strided
    return region.view(dtype).view(backing.shape[0], *shape)


def _region(num_rows: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...], device) -> torch.Tensor:
    """A region of every row as a tensor of its own (typed regions): [num_rows, *shape] of dtype,
    every byte 0xFF as in a fresh backing tensor, made on the host and moved (no byte view on
    the device)."""
    host = torch.full((num_rows, nbytes), 0xFF, dtype=torch.uint8)
    return host.view(dtype).view(num_rows, *shape).to(device)


class CachePool:
    """One rank's packed cache: the backing tensor of `num_rows` rows in `format` and its CacheViews.

    typed_regions: no backing tensor; every region (a layer's latents, index keys, KDA state) is
    a tensor of its own dtype [num_rows, ...] with the same row indices (a device that cannot
    write through dtype views of a byte tensor: `Capabilities.typed_cache_regions`, XLA). A row
    copy then copies every region; `backing` is None (no one-copy row transfer)."""

    def __init__(self, cfg: K3Config, format: CacheFormat, num_rows: int, *, device=None,
                 backing: torch.Tensor | None = None, typed_regions: bool = False):
        if format.kv_cache_dtype not in LATENT_DTYPES and format.kv_cache_dtype != "nvfp4":
            raise ValueError(f"kv cache dtype {format.kv_cache_dtype!r} cannot be served by the reference kernels "
                             f"(supported: {', '.join([*LATENT_DTYPES, 'nvfp4'])})")
        if format.kv_cache_dtype == "nvfp4" and (cfg.kv_lora_rank or 0) % NVFP4_BLOCK:
            raise ValueError(f"nvfp4 latents need kv_lora_rank % {NVFP4_BLOCK} == 0, got {cfg.kv_lora_rank}")
        if cfg.uses_dsa and format.index_cache_dtype == "mxfp4" and cfg.index_head_dim % MXFP4_BLOCK:
            raise ValueError(f"mxfp4 index keys need index_head_dim % {MXFP4_BLOCK} == 0, got {cfg.index_head_dim}")
        self.cfg, self.format, self.num_rows = cfg, format, num_rows
        self.layout = layout = format.layout(cfg)
        self.typed_regions, self.device = typed_regions, torch.device(device or "cpu")
        if typed_regions:
            self.backing = None
            self.views = self._build_views()
            return
        if backing is None:
            backing = torch.full((num_rows, layout.row_bytes), 0xFF, dtype=torch.uint8, device=device)
        if tuple(backing.shape) != (num_rows, layout.row_bytes) or backing.dtype != torch.uint8:
            raise ValueError(f"backing tensor must be uint8 [{num_rows}, {layout.row_bytes}], got "
                             f"{backing.dtype} {tuple(backing.shape)}")
        self.backing, self.device = backing, backing.device
        self.views = self._build_views()

    @classmethod
    def on_platform(cls, platform, cfg: K3Config, format: CacheFormat, num_rows: int) -> "CachePool":
        """A pool whose backing tensor the platform allocates (`k3_allocate_cache`); `format`
        carries the platform's alignment and KDA state layout (`CacheFormat.build(platform=)`).
        A platform with `typed_cache_regions` gets typed regions instead of a backing tensor."""
        if platform.capabilities.typed_cache_regions:
            return cls(cfg, format, num_rows, device=platform.info.device, typed_regions=True)
        return cls(cfg, format, num_rows, device=platform.info.device,
                   backing=platform.allocate_cache(num_rows, format.layout(cfg).row_bytes))

    @classmethod
    def for_model(cls, model, num_rows: int, *, block_size: int, platform=None, device=None,
                  **options) -> "CachePool":
        """A small pool for a model driven directly (tests, conformance, tools): `num_rows` rows
        of `block_size` tokens in the model's dtype and tensor-parallel size, allocated by
        `platform` when given (else on `device`). Rows serve as pages and state rows alike, so
        a caller keeps the two apart (e.g. state rows first, pages after them)."""
        fmt = CacheFormat.for_model(model, block_size=block_size, platform=platform, **options)
        if platform is not None:
            return cls.on_platform(platform, model.cfg, fmt, num_rows)
        return cls(model.cfg, fmt, num_rows, device=device)

    def allocate_records(self, *, slots: int, tokens: int) -> None:
        """Record buffers of the "recover" rollback (`CacheViews.kda_records`): per KDA layer,
        `slots` x `tokens` keys, decays, corrections and pre-conv inputs, NaN-poisoned."""
        la, fmt = self.cfg.linear_attn, self.format
        if la is None:
            self.views.kda_records = []
            return
        heads, d, device = la.num_heads // fmt.tensor_parallel_size, la.head_dim, self.device

        def nan(*shape, dtype=fmt.state_dtype):
            return torch.full(shape, float("nan"), dtype=dtype, device=device)

        self.views.kda_records = [
            KDARecordView(keys=nan(slots, tokens, heads, d), decays=nan(slots, tokens, heads, d),
                          corrections=nan(slots, tokens, heads, d),
                          qkv=nan(slots, tokens, 3 * heads * d, dtype=fmt.activation_dtype))
            for _ in self.cfg.kda_layer_ids]

    def _view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Region [offset, offset + nbytes) of every row: a view of the backing tensor, or a
        tensor of its own (typed regions)."""
        if self.typed_regions:
            tensor = _region(self.num_rows, nbytes, dtype, shape, self.device)
            self._regions.append(tensor)
            return tensor
        return _view(self.backing, offset, nbytes, dtype, shape)

    def _build_views(self) -> CacheViews:
        cfg, layout, fmt = self.cfg, self.layout, self.format
        self._regions: list[torch.Tensor] = []
        b = self._view
        tp = fmt.tensor_parallel_size
        regions = {r.name: r for r in layout.attention_regions + layout.state_regions}
        latent, index_keys = [], [] if cfg.uses_dsa else None
        for layer in cfg.mla_layer_ids:
            r = regions[f"layer{layer}.latent"]
            latent.append(self._latent_view(r.offset, r.nbytes))
            if cfg.uses_dsa:
                r = regions[f"layer{layer}.index_key"]
                index_keys.append(self._index_key_view(r.offset))
        kda = []
        la = cfg.linear_attn
        for layer in cfg.kda_layer_ids:
            heads = la.num_heads // tp
            rec, conv = regions[f"layer{layer}.recurrent"], regions[f"layer{layer}.conv"]
            stored = b(rec.offset, rec.nbytes, fmt.state_dtype, (heads, la.head_dim, la.head_dim))
            kda.append(KDAStateView(
                recurrent=stored if fmt.kda_state_layout == "hkv" else stored.transpose(-1, -2),
                conv=b(conv.offset, conv.nbytes, fmt.activation_dtype,
                           (3 * heads * la.head_dim, la.short_conv_kernel_size - 1)),
                layout=fmt.kda_state_layout))
        return CacheViews(kda=kda, latent=latent, index_keys=index_keys)

    def _latent_view(self, offset: int, nbytes: int) -> LatentCacheView:
        """One layer's latent region: [rows, block, R + Dr] elements of the latent dtype (fp8 in
        the format's flavour: E4M3FNUZ on AMD gfx942, OCP E4M3FN elsewhere), or
        for nvfp4 [rows, block, R/2 + R/16 + Dr] bytes of `k3.quant.nvfp4_latent` records
        (token-major) with a global scale of 1 (the fp8 latents' per-tensor scale too)."""
        cfg, block, kv = self.cfg, self.layout.block_size, self.format.kv_cache_dtype
        if kv == "nvfp4":
            rec = nvfp4_latent_record_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim or 0)
            return LatentCacheView(pages=self._view(offset, nbytes, torch.uint8, (block, rec)),
                                   scale=torch.ones((), device=self.device), fmt="nvfp4",
                                   kv_lora_rank=cfg.kv_lora_rank)
        dtype = torch.float8_e4m3fnuz if kv == "fp8" and self.format.fp8_flavour == "e4m3fnuz" else LATENT_DTYPES[kv]
        scale = torch.ones((), device=self.device) if kv == "fp8" else None
        return LatentCacheView(pages=self._view(offset, nbytes, dtype, (block, cfg.mla_latent_size)), scale=scale)

    def _index_key_view(self, offset: int) -> IndexKeyCacheView:
        """One layer's index-key region, values of every token of the block first, then their
        scales (`k3.reference.pack_index_key_page`): fp8 [block, D] e4m3fn + [block] fp32;
        mxfp4 [block, D/2] uint8 (two E2M1 codes a byte) + [block, D/32] uint8 E8M0."""
        b, block, d = self._view, self.layout.block_size, self.cfg.index_head_dim
        if self.format.index_cache_dtype == "mxfp4":
            values = b(offset, block * d // 2, torch.uint8, (block, d // 2))
            scales = b(offset + block * d // 2, block * d // MXFP4_BLOCK, torch.uint8, (block, d // MXFP4_BLOCK))
            return IndexKeyCacheView(values=values, scales=scales, fmt="mxfp4")
        values = b(offset, block * d, torch.float8_e4m3fn, (block, d))
        scales = b(offset + block * d, block * 4, torch.float32, (block,))
        return IndexKeyCacheView(values=values, scales=scales, fmt="fp8")

    def copy_row(self, src: int, dst: int) -> None:
        """Move one block (all layers) in one copy (typed regions: one copy per region)."""
        if self.typed_regions:
            for region in self._regions:
                region[dst].copy_(region[src])
            return
        self.backing[dst].copy_(self.backing[src])


def kernel_page_table(block_table: torch.Tensor, *, block_size: int, kernel_page: int) -> torch.Tensor:
    """Translate a block table of rows [N, R] into kernel page ids [N, R * J], J = block_size /
    kernel_page: page k lives in row k // J at token offset (k % J) * kernel_page.

    Kernels index small fixed pages (e.g. 64 tokens) while a row holds a whole block; this is
    the translation the engine applies before each step, so kernels never see the row format.
    """
    if block_size % kernel_page:
        raise ValueError(f"the kernel page ({kernel_page}) must divide the block size ({block_size})")
    j = block_size // kernel_page
    pages = block_table.long()[..., None] * j + torch.arange(j, device=block_table.device)
    return pages.flatten(-2)


def kernel_page_offsets(view_pages: torch.Tensor, pages: torch.Tensor, *, kernel_page: int) -> torch.Tensor:
    """Element offsets (into the view's storage) of the first token of each kernel page:
    row stride x (k // J) + token stride x kernel_page x (k % J). A kernel adds the token and
    channel offsets within the page. view_pages: a layer's [rows, block, record] view."""
    j = view_pages.shape[1] // kernel_page
    row_stride, token_stride = view_pages.stride(0), view_pages.stride(1)
    return view_pages.storage_offset() + (pages // j) * row_stride + (pages % j) * kernel_page * token_stride
