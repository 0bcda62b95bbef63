"""Tokenizers for Kimi K3-architecture checkpoints.

- `Tokenizer`: the interface (encode / decode, the special-token table, bos / eos / pad ids,
  each possibly absent; flavor "k3", "k2" or None when the vocabulary has no chat markers).
- `load_tokenizer(model_dir)`: a checkpoint's tokenizer, from `tiktoken.model` +
  `tokenizer_config.json`, else `tokenizer.json` (byte-level BPE natively, any other kind
  wrapped whole: `WrappedHFTokenizer`), else the built-in compact vocabulary.
- `compact_tokenizer(flavor)` / `write_compact_tokenizer(model_dir, flavor=...)`: the tiny
  checkpoints' 512-token vocabulary, built in code or written as files.
- `IncrementalDetokenizer`: streaming, UTF-8-safe detokenisation for one request.

Special-token ids come from a tokenizer's own table (`tok.token_id("<|end_of_msg|>")`);
`k3.tokenizer.specials` is the only module that spells them.
"""

from k3.tokenizer.base import Tokenizer
from k3.tokenizer.compact import compact_tokenizer, write_compact_tokenizer
from k3.tokenizer.detokenize import IncrementalDetokenizer
from k3.tokenizer.loader import load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer", "compact_tokenizer", "write_compact_tokenizer",
           "IncrementalDetokenizer"]
