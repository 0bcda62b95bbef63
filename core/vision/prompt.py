"""Image placeholders in a token prompt: one `media_placeholder_token_id` per image in the rendered
prompt becomes as many placeholders as the image has embedding rows, and the rows are stacked in
prompt order — what `K3Model.embed(input_ids, media_embeds)` takes."""
from __future__ import annotations

from typing import Sequence

import torch


def expand_media_placeholders(token_ids: Sequence[int], image_token_counts: Sequence[int],
                              placeholder_id: int) -> list[int]:
    """Each placeholder of `token_ids` (one per image, in order) repeated its image's token count."""
    slots = [i for i, t in enumerate(token_ids) if t == placeholder_id]
    if len(slots) != len(image_token_counts):
        raise ValueError(f"prompt has {len(slots)} image placeholders for {len(image_token_counts)} images")
    out: list[int] = []
    counts = iter(image_token_counts)
    for t in token_ids:
        out.extend([t] * next(counts) if t == placeholder_id else [t])
    return out


def stack_media_embeds(embeds: Sequence[torch.Tensor], input_ids: torch.Tensor, placeholder_id: int) -> torch.Tensor:
    """Per-image embeddings -> [placeholders, d], checked against the expanded prompt's placeholder count."""
    rows = torch.cat(list(embeds)) if embeds else torch.empty(0)
    n = int((input_ids == placeholder_id).sum())
    if rows.shape[0] != n:
        raise ValueError(f"{rows.shape[0]} image embedding rows for {n} placeholder tokens")
    return rows
