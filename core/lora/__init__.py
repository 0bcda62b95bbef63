"""LoRA adapters: PEFT-format files read and checked against the model's targets
(`peft_format`), and the registry of loaded adapters and their slots (`registry`). The per-row
op is `k3.reference.lora`, the slots on the model graph `k3.model.lora`; docs/lora.md."""

from .peft_format import LoRAFormatError, PeftAdapter, read_peft_adapter
from .registry import LoRAError, LoRANotFound, LoRARegistry, LoadedAdapter

__all__ = ["LoRAError", "LoRAFormatError", "LoRANotFound", "LoRARegistry", "LoadedAdapter", "PeftAdapter",
           "read_peft_adapter"]
