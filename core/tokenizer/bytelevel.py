"""The byte-level alphabet: one printable character per byte value.

Byte-level BPE vocabularies (HF `tokenizers` ByteLevel, GPT-2 style) spell a token's bytes with
these characters so that every token is a printable string: bytes that are printable Latin-1
characters ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves, the other 68 bytes take the
characters U+0100, U+0101, ... in byte order. `Tokenizer.id_to_token` uses the same spelling
for regular tokens, so names round-trip through `token_id` for every source.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def byte_to_char() -> tuple[str, ...]:
    """The character that spells each byte value (index = byte)."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out: list[str] = []
    extra = 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(0x100 + extra))
            extra += 1
    return tuple(out)


@lru_cache(maxsize=1)
def char_to_byte() -> dict[str, int]:
    """Inverse of `byte_to_char`."""
    return {c: b for b, c in enumerate(byte_to_char())}


def to_chars(data: bytes) -> str:
    """Spell bytes in the byte-level alphabet."""
    table = byte_to_char()
    return "".join(table[b] for b in data)


def from_chars(text: str) -> bytes:
    """Bytes spelt by a byte-level string; ValueError names the first foreign character."""
    table = char_to_byte()
    try:
        return bytes(table[c] for c in text)
    except KeyError as e:
        raise ValueError(f"{text!r} is not a byte-level token: {e.args[0]!r} spells no byte") from None
