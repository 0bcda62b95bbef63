"""Chat `image_url` parts -> decoded images for the engine, under the server's media policy.

`data:image/...;base64,` URLs are always taken. Local files (`file://PATH` or a bare path) only
under `--allowed-local-media-path DIR` (vLLM's flag): the resolved path must lie inside DIR.
http(s) URLs are refused unless `--allow-remote-media`; then the server fetches them itself
(timeout and byte limit). Every problem is a 400 naming it (`ImageInputError`'s message:
not an image, truncated, too large, scheme not allowed), code `invalid_image`.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from k3.vision.media import MAX_IMAGE_BYTES, ImageInputError, MediaPolicy, decode_image_bytes, load_image

from .errors import bad_request


@dataclass(frozen=True)
class MediaOptions:
    """The server's image policy (see the module docstring)."""

    allowed_local_media_path: str | None = None
    allow_remote_media: bool = False
    fetch_timeout_s: float = 10.0
    max_bytes: int = MAX_IMAGE_BYTES


def _local_path(url: str) -> Path:
    return Path(url[len("file://"):] if url.startswith("file://") else url)


def _fetch(url: str, options: MediaOptions) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=options.fetch_timeout_s) as resp:   # noqa: S310 - http(s) only
            data = resp.read(options.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ImageInputError(f"cannot fetch image {url[:80]!r}: {getattr(e, 'reason', e)}") from None
    if len(data) > options.max_bytes:
        raise ImageInputError(f"image at {url[:80]!r} is more than the limit of {options.max_bytes} bytes")
    return data


def load_one(url: str, options: MediaOptions) -> torch.Tensor:
    """One image_url value -> float32 RGB [3, H, W]; ImageInputError naming the problem."""
    policy = MediaPolicy(allow_local_files=options.allowed_local_media_path is not None,
                         allow_remote_urls=options.allow_remote_media, max_bytes=options.max_bytes)
    if url.startswith(("http://", "https://")) and options.allow_remote_media:
        return decode_image_bytes(_fetch(url, options), policy)
    if not url.startswith("data:") and "://" not in url.replace("file://", "", 1) and policy.allow_local_files:
        root = Path(options.allowed_local_media_path).resolve()
        path = _local_path(url).resolve()
        if not path.is_relative_to(root):
            raise ImageInputError(f"local image {str(path)!r} is outside the allowed media path {str(root)!r}")
        return load_image(str(path), policy)
    return load_image(url, policy)


def load_chat_images(urls: list[str], options: MediaOptions) -> list[torch.Tensor]:
    """The images of a chat request in prompt order; a 400 (param `messages`) for a bad one."""
    images = []
    for i, url in enumerate(urls):
        try:
            images.append(load_one(url, options))
        except ImageInputError as e:
            raise bad_request(f"image {i} of the request: {e}", param="messages", code="invalid_image") from None
    return images
