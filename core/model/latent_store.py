"""Writing MLA latent rows into a layer's cache view and reading them back for the kernels.

The attention kernels read plain latent pages (bf16 / fp32 / fp64, or fp8 with a per-tensor
scale, `k3.plugin.kernels.MLADecode`). An nvfp4 view (`LatentCacheView.fmt`) holds
`k3.quant.nvfp4_latent` records instead: rows are quantised on store with the platform's
NVFP4 and FP8 codecs, and read through a dense copy of just the pages a block table names
(`readable_latents`), so every kernel serves nvfp4 caches unchanged. The copy costs one
dequantise of the batch's pages per layer and step (no host synchronisation); a kernel that
reads NVFP4 pages natively would skip it.
"""

from __future__ import annotations

import torch

from k3.model.metadata import LatentCacheView
from k3.plugin.tables import KernelSet
from k3.quant.nvfp4_latent import nvfp4_latent_dequantize, nvfp4_latent_quantize


def encode_latents(kernels: KernelSet, view: LatentCacheView, rows: torch.Tensor) -> torch.Tensor:
    """Rows [T, R + Dr] as the view stores them (its dtype, fp8 with its scale, or nvfp4 records)."""
    if view.fmt == "nvfp4":
        return nvfp4_latent_quantize(rows, kv_lora_rank=view.kv_lora_rank, global_scale=view.scale,
                                     quant=kernels.quant)
    if view.scale is None:
        return rows.to(view.pages.dtype)
    return kernels.quant.fp8_quantize(rows, scale=view.scale, dtype=view.pages.dtype)[0]


def store_latents(kernels: KernelSet, view: LatentCacheView, at: tuple[torch.Tensor, torch.Tensor],
                  rows: torch.Tensor) -> None:
    """Write rows [T, R + Dr] at (pages, offsets) [T], quantised as the view stores them."""
    view.pages[at] = encode_latents(kernels, view, rows)


def decode_latent_rows(kernels: KernelSet, view: LatentCacheView, stored: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """Stored rows [..., record] of the view (gathered from its pages) -> [..., R + Dr] in dtype."""
    if view.fmt == "nvfp4":
        return nvfp4_latent_dequantize(stored, kv_lora_rank=view.kv_lora_rank, global_scale=view.scale,
                                       dtype=dtype, quant=kernels.quant)
    if view.scale is not None:
        return kernels.quant.fp8_dequantize(stored, view.scale, dtype=dtype)
    return stored.to(dtype)


def readable_latents(kernels: KernelSet, view: LatentCacheView, block_table: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(pages, kv_cache_scale, block_table) for an MLA kernel reading the pages of block_table
    [N, max_pages]: a plain view's own pages, scale and table; an nvfp4 view's named pages
    dequantised to dtype, [N * max_pages, page, R + Dr], with the table [N, max_pages] of
    their new ids (the same positions in the same order)."""
    if view.fmt != "nvfp4":
        return view.pages, view.scale, block_table
    n, m = block_table.shape
    stored = view.pages[block_table.reshape(-1).long()]                       # [N * M, page, record]
    pages = decode_latent_rows(kernels, view, stored, dtype)
    table = torch.arange(n * m, dtype=block_table.dtype, device=block_table.device).view(n, m)
    return pages, None, table
