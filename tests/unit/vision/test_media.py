"""image_url values -> pixels, and the clear errors for bad images (the server's 400 messages)."""
import base64
import io

import pytest
import torch
from PIL import Image

from k3.vision.media import ImageInputError, MediaPolicy, image_content_hash, load_image


def _png(w=5, h=3, color=(255, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_data_url_decodes_to_rgb():
    px = load_image(_data_url(_png()))
    assert px.shape == (3, 3, 5)
    torch.testing.assert_close(px[:, 0, 0], torch.tensor([1.0, 0.0, 0.0]))


@pytest.mark.parametrize("url,problem", [
    (_data_url(_png(64, 64)[:-30]), "truncated or corrupt"),   # header intact, pixel data cut
    (_data_url(b"GIF89a not really"), "truncated or corrupt|not a recognised"),
    (_data_url(b"plain text"), "not a recognised image format"),
    (_data_url(_png(), mime="text/plain"), "not an image type"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("https://example.com/cat.png", "remote image URLs are not allowed"),
    ("/etc/hostname", "local image files are not allowed"),
    ("ftp://host/x.png", "unsupported image URL scheme|not allowed"),
])
def test_bad_images_name_the_problem(url, problem):
    with pytest.raises(ImageInputError, match=problem):
        load_image(url)


def test_size_limits_and_local_files(tmp_path):
    with pytest.raises(ImageInputError, match="pixels, more than the limit"):
        load_image(_data_url(_png(100, 100)), MediaPolicy(max_pixels=99 * 100))
    with pytest.raises(ImageInputError, match="bytes, more than the limit"):
        load_image(_data_url(_png()), MediaPolicy(max_bytes=10))
    (tmp_path / "a.png").write_bytes(_png(color=(0, 0, 255)))
    px = load_image(f"file://{tmp_path / 'a.png'}", MediaPolicy(allow_local_files=True))
    assert px.shape == (3, 3, 5)
    with pytest.raises(ImageInputError, match="cannot read local image"):
        load_image(str(tmp_path / "missing.png"), MediaPolicy(allow_local_files=True))


def test_content_hash_same_picture_same_key():
    a, b = load_image(_data_url(_png())), load_image(_data_url(_png()))
    c = load_image(_data_url(_png(color=(254, 0, 0))))
    assert image_content_hash(a) == image_content_hash(b) != image_content_hash(c)
