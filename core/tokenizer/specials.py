"""The special-token tables: the one place in k3 that knows special-token ids.

Kimi vocabularies put their special tokens after the regular tokens, at 163584 and above. Two
naming schemes share those slots:

- "k3": Kimi K3's XTML tokens (`<|open|>`, `<|close|>`, `<|sep|>`, `<|end_of_msg|>`, ...).
- "k2": Kimi K2 / Kimi-Linear's `<|im_*|>`, tool-section and `<think>` tokens.

A checkpoint's tokenizer files are the authority for a real model; these tables name the slots
of the compact vocabulary the tiny checkpoints are built with (see `compact.py`). Every other
module asks a `Tokenizer` for ids, by name.
"""

from __future__ import annotations

FLAVORS = ("k3", "k2")

# First special id of the real (163,840-token) Kimi vocabularies; the last slot is 163839.
KIMI_SPECIAL_BASE = 163584
KIMI_VOCAB_SIZE = 163840

# Names the `Tokenizer` interface resolves, per flavor.
BOS = "[BOS]"
EOS = "[EOS]"
PAD = "[PAD]"
UNK = "[UNK]"
END_OF_MESSAGE = {"k3": "<|end_of_msg|>", "k2": "<|im_end|>"}

# Roles a tokenizer may name a special token for (tokenizer_config.json's `<role>_token`), and
# the Kimi names that play them when the config names none.
ROLES = ("bos", "eos", "pad")
KIMI_ROLE_NAMES = {"bos": BOS, "eos": EOS, "pad": PAD}

# The marker tokens each chat format's renderer emits for a conversation (k3.chat.render_k3 /
# render_k2; tool-call markers are only needed when tools are used).
CHAT_MARKERS = {
    "k3": ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"),
    "k2": ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"),
}
CHAT_FORMAT_NAMES = {"k3": "K3 XTML", "k2": "K2 <|im_*|>"}

# Kimi K3 (docs/k3-architecture.md section 5). The names of 163602-163604 are not in the K3
# sources we have; K2's media names are used for them.
K3_SPECIALS: dict[int, str] = {
    163584: BOS,
    163585: EOS,
    163586: "<|end_of_msg|>",
    163587: "<|open|>",
    163588: "<|close|>",
    163589: "<|sep|>",
    163590: "[start_header_id]",
    163591: "[end_header_id]",
    163593: "[EOT]",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|kimi_image_placeholder|>",
    163649: "<osagent_mode>",
    163838: UNK,
    163839: PAD,
}

# Kimi K2 / Kimi-Linear (docs/k3-model-math.md section 10.1).
K2_SPECIALS: dict[int, str] = {
    163584: BOS,
    163585: EOS,
    163586: "<|im_end|>",
    163587: "<|im_user|>",
    163588: "<|im_assistant|>",
    163590: "<|start_header_id|>",
    163591: "<|end_header_id|>",
    163593: "[EOT]",
    163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>",
    163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>",
    163599: "<|tool_call_end|>",
    163601: "<|im_middle|>",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163606: "<think>",
    163607: "</think>",
    163838: UNK,
    163839: PAD,
}

KIMI_SPECIALS = {"k3": K3_SPECIALS, "k2": K2_SPECIALS}


def reserved_name(token_id: int) -> str:
    """Name of an unnamed special slot, as Kimi's tokenizers spell it."""
    return f"<|reserved_token_{token_id}|>"


def flavor_of(special_tokens: dict[str, int]) -> str | None:
    """"k3" if a special-token table holds <|end_of_msg|>, else "k2" if it holds <|im_end|>,
    else None (no Kimi chat format)."""
    for flavor in FLAVORS:
        if END_OF_MESSAGE[flavor] in special_tokens:
            return flavor
    return None
