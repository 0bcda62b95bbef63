"""Image parts of OpenAI-style chat content, and how the K3 prompt marks an image.

A user message's content may mix text parts with ``{"type": "image_url", "image_url": {"url":
URL}}`` parts (``image_url`` may also be the URL string itself). The K3 renderer writes each image
as ``<|media_begin|>image<|media_content|><|kimi_image_placeholder|><|media_end|>``: one
placeholder token, which the engine expands to the image's embedding rows (k3.engine.media). The
bracketing follows the Kimi-VL / K2.5 image layout with K3's token names (k3-architecture.md
section 5 lists the tokens 163602-163605; the released K3 renderer's exact layout is not in our
sources). Images are taken in user messages only; `image_urls` lists them in prompt order, which
is the order the renderer writes their placeholders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from k3.chat.errors import ChatTemplateError

MEDIA_BEGIN = "<|media_begin|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_END = "<|media_end|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
TEXT_PARTS = ("text", "input_text", "output_text")


def image_url_of(part: Any, where: str) -> str | None:
    """The URL of an ``image_url`` part (None for any other part)."""
    if not isinstance(part, Mapping) or part.get("type") != "image_url":
        return None
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, Mapping) else ref
    if not isinstance(url, str) or not url:
        raise ChatTemplateError(f"{where} needs image_url.url (a data: URL or a file path)")
    return url


def user_parts(content: Any, where: str) -> list[tuple[str, str]]:
    """A user message's content as ("text", text) and ("image", url) pieces in order."""
    if content is None:
        return []
    if isinstance(content, str):
        return [("text", content)]
    if not isinstance(content, Sequence):
        raise ChatTemplateError(f"{where}.content must be a string or a list of parts")
    out = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            out.append(("text", part))
            continue
        url = image_url_of(part, f"{where}.content[{j}]")
        if url is not None:
            out.append(("image", url))
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"{where}.content[{j}] of type {kind!r} is not supported: k3 chat takes "
                                    "text parts, and image_url parts in user messages")
        out.append(("text", part["text"]))
    return out


def image_urls(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The image URLs of a conversation's user messages, in prompt order."""
    urls = []
    for i, msg in enumerate(messages):
        if isinstance(msg, Mapping) and msg.get("role") == "user":
            urls += [url for kind, url in user_parts(msg.get("content"), f"messages[{i}]") if kind == "image"]
    return urls
