"""Image references of chat `image_url` parts -> decoded RGB tensors, with errors that name the problem.

`load_image(url, policy)` accepts `data:image/...;base64,...` URLs always, `file://` paths and bare
local paths only when `policy.allow_local_files` is set, and refuses http(s) URLs unless
`policy.allow_remote_urls` is set (k3 itself never fetches them: the caller passes the bytes through
`decode_image_bytes`). Every failure raises `ImageInputError`, a ValueError whose message says what is
wrong (not an image, truncated, too large, unsupported scheme) — the server maps it to a 400.

`image_content_hash(pixels)` keys an image by its decoded pixels, for prefix caching: the same
picture sent as PNG or as a data URL of the same bytes shares a key, different pictures never do.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_IMAGE_BYTES = 32 * 1024 * 1024
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class ImageInputError(ValueError):
    """A client's image could not be used; the message names the problem (a 400 for the server)."""


@dataclass(frozen=True)
class MediaPolicy:
    allow_local_files: bool = False
    allow_remote_urls: bool = False
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS


def decode_image_bytes(data: bytes, policy: MediaPolicy = MediaPolicy()) -> torch.Tensor:
    """Encoded image bytes -> float32 RGB tensor [3, H, W] in [0, 1]."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > policy.max_bytes:
        raise ImageInputError(f"image is {len(data)} bytes, more than the limit of {policy.max_bytes}")
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if w * h > policy.max_pixels:
                raise ImageInputError(f"image is {w}x{h} pixels, more than the limit of {policy.max_pixels}")
            img.load()
            rgb = img.convert("RGB")
    except UnidentifiedImageError:
        raise ImageInputError("image data is not a recognised image format (PNG, JPEG, WebP, GIF, ...)") from None
    except Image.DecompressionBombError as e:
        raise ImageInputError(f"image is too large to decode: {e}") from None
    except (OSError, SyntaxError) as e:
        raise ImageInputError(f"image data is truncated or corrupt: {e}") from None
    t = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).reshape(h, w, 3)
    return t.permute(2, 0, 1).to(torch.float32) / 255.0


def load_image(url: str, policy: MediaPolicy = MediaPolicy()) -> torch.Tensor:
    """An `image_url.url` value -> float32 RGB [3, H, W] (see the module docstring for what is allowed)."""
    if not isinstance(url, str) or not url:
        raise ImageInputError("image_url.url must be a non-empty string")
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ImageInputError("image data URL must be data:image/<type>;base64,<data>")
        if not header[5:].startswith("image/"):
            raise ImageInputError(f"data URL media type {header[5:-7]!r} is not an image type")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageInputError("image data URL payload is not valid base64") from None
        return decode_image_bytes(data, policy)
    if url.startswith(("http://", "https://")):
        if not policy.allow_remote_urls:
            raise ImageInputError("remote image URLs are not allowed on this server (send a data: URL)")
        raise ImageInputError("remote image URLs must be fetched by the caller; pass the bytes")
    path = Path(url[len("file://"):] if url.startswith("file://") else url)
    if "://" in url and not url.startswith("file://"):
        raise ImageInputError(f"unsupported image URL scheme in {url[:40]!r}")
    if not policy.allow_local_files:
        raise ImageInputError("local image files are not allowed on this server (send a data: URL)")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ImageInputError(f"cannot read local image {str(path)!r}: {e.strerror}") from None
    return decode_image_bytes(data, policy)


def image_content_hash(pixels: torch.Tensor) -> bytes:
    """32-byte key of a decoded image: its shape and its pixels (float32 bytes)."""
    h = hashlib.sha256(repr(tuple(pixels.shape)).encode())
    h.update(pixels.to(torch.float32).contiguous().numpy().tobytes())
    return h.digest()
