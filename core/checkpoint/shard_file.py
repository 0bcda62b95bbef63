"""Opening one safetensors shard, with an error that names the file and what is wrong with it.

safetensors' own errors ("Error while deserializing header: header too large") name neither
the file nor the likely cause (a truncated download, an empty file, a file that is not
safetensors at all). `open_shard` reads the 8-byte header length first and states what it
found; any other failure to open becomes a `CheckpointError` naming the file.
"""

from __future__ import annotations

import struct
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError, safe_open

HEADER_LENGTH_BYTES = 8       # little-endian u64: the JSON header's length
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on the header


def check_shard(path: Path, error: type[Exception]) -> None:
    """Raise `error` naming `path` when it cannot be a safetensors file: missing, shorter than
    its header length field, or declaring a header longer than the file or the format's bound."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise error(f"{path}: cannot read the shard ({e.strerror or e})") from None
    if size < HEADER_LENGTH_BYTES:
        raise error(f"{path}: {size} bytes, too short for a safetensors file (an empty or truncated download?)")
    with path.open("rb") as f:
        (header,) = struct.unpack("<Q", f.read(HEADER_LENGTH_BYTES))
    if header > MAX_HEADER_BYTES or HEADER_LENGTH_BYTES + header > size:
        raise error(f"{path}: declares a {header}-byte header in a {size}-byte file: truncated, or not a "
                    "safetensors file")


@contextmanager
def open_shard(path: Path, error: type[Exception]):
    """safe_open(path) for torch, after `check_shard`; a safetensors error while opening (a
    corrupt header, data that does not cover the declared tensors) becomes `error` naming the
    file."""
    path = Path(path)
    check_shard(path, error)
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        hint = " (truncated download?)" if "not fully covered" in str(e) else ""
        raise error(f"{path}: not a readable safetensors file: {e}{hint}") from None
    with handle as f:
        yield f
