"""The preprocessed-image cache (vLLM's multi-modal processor cache, `mm_processor_cache_gb`).

An image seen before, keyed by its content hash (`k3.vision.media.image_content_hash` of the
decoded pixels), skips the navit resize, normalisation and patchify: its patches and patch grid
come back from the cache. Least recently used entries go first once the patches held exceed the
byte budget. Lookups and hits are what vLLM exports as `vllm:mm_cache_queries` / `_hits`.
A request holds its patches itself, so an entry evicted while the request runs costs nothing.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class PreprocessedImageCache:
    """content hash -> (patches [h*w, 3, P, P], grid (h, w)), at most `capacity_bytes` of patches."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self._entries: OrderedDict[bytes, tuple[torch.Tensor, tuple[int, int]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """The entry of `key` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: bytes, patches: torch.Tensor, grid: tuple[int, int]) -> None:
        """Remember an image's patches (not when they alone exceed the budget), evicting the least
        recently used entries until the rest fits."""
        size = patches.numel() * patches.element_size()
        if size > self.capacity_bytes or key in self._entries:
            return
        while self.bytes + size > self.capacity_bytes:
            _, (old, _grid) = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        self._entries[key] = (patches, grid)
        self.bytes += size
