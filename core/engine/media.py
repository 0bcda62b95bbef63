"""Images of a request through the engine: placeholder expansion, the encoder run, the per-step rows.

A request with images carries a `RequestMedia`: one `MediaItem` per image (its patches, its
placeholder span in the prompt and its content hash) and the encoder outputs computed for it so
far. `MediaEncoder` (built from the checkpoint's vision tower) turns a prompt with one
`media_placeholder_token_id` per image into the expanded prompt (`prepare`), encodes the images a
step reaches that are not encoded yet, all of the step's in one packed tower call (`encode_step`),
and gives the step's embedding rows with the batch rows they replace (`step_embeds`). A prefill
chunk that ends inside an image takes the rows up to its end; the next chunk takes the rest from
the request's cached output. The scheduler budgets the encoder (`tokens_to_encode`), prefix
caching keys a unit covering a placeholder by the image's content hash (`RequestMedia.spans`), and
the request's encoder outputs are dropped when it leaves the scheduler (`RequestMedia.free`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from k3.vision.media import image_content_hash
from k3.vision.moonvit import MoonViTTower
from k3.vision.preprocess import image_to_patches, plan_resize
from k3.vision.prompt import expand_media_placeholders

from .media_cache import PreprocessedImageCache

# The K3 image processor's navit limits (media_proc_cfg); a vision_config may override them.
IN_PATCH_LIMIT = 16384
PATCH_LIMIT_ON_ONE_SIDE = 512


@dataclass
class MediaItem:
    """One image of a request: its placeholder span [offset, offset + num_tokens) in the prompt."""

    offset: int
    num_tokens: int
    key: bytes                   # image_content_hash of the decoded pixels
    patches: torch.Tensor        # [h*w, 3, P, P]
    grid: tuple[int, int]


@dataclass
class RequestMedia:
    """A request's images and its encoder outputs (image index -> [num_tokens, d])."""

    items: list[MediaItem]
    embeds: dict[int, torch.Tensor] = field(default_factory=dict)
    num_encoded: int = 0         # images encoded for this request (the encoder runs once per image)

    @property
    def spans(self) -> list[tuple[int, int, bytes]]:
        """(offset, num_tokens, content hash) per image: what prefix-cache keys mix in."""
        return [(m.offset, m.num_tokens, m.key) for m in self.items]

    def overlapping(self, start: int, end: int) -> list[int]:
        """Indices of the images whose placeholder span meets positions [start, end)."""
        return [i for i, m in enumerate(self.items) if m.offset < end and start < m.offset + m.num_tokens]

    def pending(self, start: int, end: int) -> list[int]:
        """The images a chunk [start, end) needs whose encoder output is not cached yet."""
        return [i for i in self.overlapping(start, end) if i not in self.embeds]

    def free(self) -> None:
        """Drop the encoder outputs (the request finished, was aborted or left)."""
        self.embeds.clear()

    def copy(self) -> "RequestMedia":
        """The same images with an encoder cache of its own (another sample of an n > 1 request)."""
        return RequestMedia(list(self.items))


def tokens_to_encode(media: RequestMedia | None, start: int, num_new: int, budget: int) -> tuple[int, int]:
    """(tokens of the chunk [start, start + num_new) that fit, encoder tokens they need) under an
    encoder budget of `budget` tokens this step: the chunk stops before the first image not
    encoded yet that would exceed the budget (0 tokens: the request waits for the next step)."""
    if media is None:
        return num_new, 0
    used = 0
    for i in media.pending(start, start + num_new):
        item = media.items[i]
        if used + item.num_tokens > budget:
            return max(0, item.offset - start), used
        used += item.num_tokens
    return num_new, used


def pixels_of(image: Any) -> torch.Tensor:
    """An image as given to the engine -> float32 RGB [3, H, W] in [0, 1]: a tensor of that shape
    (float in [0, 1], or uint8), or a PIL image."""
    if isinstance(image, torch.Tensor):
        if image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"an image tensor must be RGB [3, H, W], got shape {tuple(image.shape)}")
        return image.to(torch.float32) / 255.0 if image.dtype == torch.uint8 else image.to(torch.float32)
    if hasattr(image, "convert") and hasattr(image, "size"):        # a PIL image
        rgb = image.convert("RGB")
        w, h = rgb.size
        t = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).reshape(h, w, 3)
        return t.permute(2, 0, 1).to(torch.float32) / 255.0
    raise ValueError(f"an image must be a [3, H, W] tensor or a PIL image, not {type(image).__name__}")


def images_of(multi_modal_data: Mapping[str, Any] | None) -> list:
    """The images of vLLM's `multi_modal_data` ({"image": one image or a list}); other modalities
    are refused."""
    if not multi_modal_data:
        return []
    other = sorted(set(multi_modal_data) - {"image"})
    if other:
        raise ValueError(f"multi_modal_data takes 'image' only, not {', '.join(other)}")
    images = multi_modal_data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


class MediaEncoder:
    """The engine's vision tower and preprocessing (see the module docstring).

    tower: the MoonViT tower (its parameters on `device`, in `dtype`); placeholder_id: the
    model's media_placeholder_token_id; in_patch_limit / patch_limit_on_one_side: the navit
    resize limits; cache_bytes: the preprocessed-image cache's budget (0: off)."""

    def __init__(self, tower: MoonViTTower, placeholder_id: int, *, dtype: torch.dtype, device,
                 in_patch_limit: int = IN_PATCH_LIMIT, patch_limit_on_one_side: int = PATCH_LIMIT_ON_ONE_SIDE,
                 cache_bytes: int = 0):
        self.tower, self.placeholder_id, self.dtype, self.device = tower, placeholder_id, dtype, device
        self.in_patch_limit, self.patch_limit_on_one_side = in_patch_limit, patch_limit_on_one_side
        # images seen before skip preprocessing (vLLM's mm processor cache; None: off)
        self.cache = PreprocessedImageCache(cache_bytes) if cache_bytes > 0 else None
        self.max_images: int | None = None          # images a prompt may carry (None: no limit)
        # encode(patches, grids) -> one output per image: the tower, or under tensor parallelism
        # the TP ranks' run (k3.engine.distributed.tp.TPSender.encode)
        self.encode_fn = None
        self.tp_mode = "weights"        # the resolved mm_encoder_tp_mode under TP (k3.vision.tensor_parallel)
        self.stats = {"mm_images_total": 0, "mm_encoder_runs_total": 0, "mm_encoder_tokens_total": 0,
                      "mm_cache_queries_total": 0, "mm_cache_hits_total": 0}

    @property
    def max_tokens_per_image(self) -> int:
        """Placeholders the largest image takes (in_patch_limit patches, merged)."""
        kh, kw = self.tower.cfg.merge_kernel
        return self.in_patch_limit // (kh * kw)

    def num_tokens(self, image: Any) -> int:
        """Placeholders an image expands to (the navit plan, without patching it)."""
        pixels = pixels_of(image)
        cfg = self.tower.cfg
        return plan_resize(pixels.shape[2], pixels.shape[1], patch_size=cfg.patch_size,
                           merge_kernel=cfg.merge_kernel[0], in_patch_limit=self.in_patch_limit,
                           patch_limit_on_one_side=self.patch_limit_on_one_side).num_tokens

    def prepare(self, prompt_ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], RequestMedia]:
        """(the prompt with each image's placeholder expanded, its RequestMedia); ValueError when the
        prompt's placeholders and the images do not pair up."""
        cfg = self.tower.cfg
        if self.max_images is not None and len(images) > self.max_images:
            raise ValueError(f"the prompt has {len(images)} images; this server takes at most {self.max_images} "
                             "(limit_mm_per_prompt)")
        items, counts = [], []
        for image in images:
            pixels = pixels_of(image)
            key = image_content_hash(pixels)
            patches, grid = self._patches(pixels, key)
            counts.append(self.tower.tokens_for_grid(*grid))
            items.append(MediaItem(0, counts[-1], key, patches, grid))
        ids = expand_media_placeholders(list(prompt_ids), counts, self.placeholder_id)
        # placeholders of consecutive images touch: walk the expanded prompt image by image
        pos = 0
        for item in items:
            while ids[pos] != self.placeholder_id:
                pos += 1
            item.offset = pos
            pos += item.num_tokens
        return ids, RequestMedia(items)

    def _patches(self, pixels: torch.Tensor, key: bytes) -> tuple[torch.Tensor, tuple[int, int]]:
        """An image's patches and grid: from the preprocessed cache when it holds the image."""
        cfg = self.tower.cfg
        if self.cache is not None:
            self.stats["mm_cache_queries_total"] += 1
            hit = self.cache.get(key)
            if hit is not None:
                self.stats["mm_cache_hits_total"] += 1
                return hit
        patches, grid = image_to_patches(pixels, patch_size=cfg.patch_size, merge_kernel=cfg.merge_kernel[0],
                                         in_patch_limit=self.in_patch_limit,
                                         patch_limit_on_one_side=self.patch_limit_on_one_side)
        if self.cache is not None:
            self.cache.put(key, patches, grid)
        return patches, grid

    def encode_step(self, scheduled) -> None:
        """Encode, in one packed tower call, every image the scheduled chunks reach that their
        requests have not encoded yet (`ScheduledRequest`s: request.media, num_computed_tokens,
        num_new_tokens)."""
        todo = []
        for s in scheduled:
            media = s.request.media
            if media is not None:
                start = s.request.num_computed_tokens
                todo += [(media, i) for i in media.pending(start, start + s.num_new_tokens)]
        if not todo:
            return
        patches = torch.cat([m.items[i].patches for m, i in todo]).to(device=self.device, dtype=self.dtype)
        outs = (self.encode_fn or self.tower.encode)(patches, [m.items[i].grid for m, i in todo])
        for (media, i), emb in zip(todo, outs):
            media.embeds[i] = emb
            media.num_encoded += 1
        self.stats["mm_encoder_runs_total"] += 1
        self.stats["mm_encoder_tokens_total"] += sum(m.items[i].num_tokens for m, i in todo)

    def step_embeds(self, scheduled, token_starts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(embedding rows [R, d], their batch rows [R]) of a step whose requests' chunks start at
        packed rows `token_starts`; None when no chunk covers an image placeholder."""
        rows, where = [], []
        for s, first in zip(scheduled, token_starts):
            media = s.request.media
            if media is None or s.lookahead:
                continue
            start = s.request.num_computed_tokens
            end = start + s.num_new_tokens
            for i in media.overlapping(start, end):
                item = media.items[i]
                lo, hi = max(start, item.offset), min(end, item.offset + item.num_tokens)
                rows.append(media.embeds[i][lo - item.offset: hi - item.offset])
                where.append(torch.arange(first + lo - start, first + hi - start))
        if not rows:
            return None
        return torch.cat(rows), torch.cat(where).to(self.device)
