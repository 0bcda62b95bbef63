"""The built-in conformance cases, one module per family; importing this package registers them."""

from . import attn_res, cache, collectives, dense, elementwise, indexer, kda, lora, mla, model, model_bitwise, moe  # noqa: F401
from . import quant, variants, variants_kda  # noqa: F401
