"""The K3 model graph (pure torch, reference ops, tensor-parallel ready)."""

from .batch import ForwardBatch, ModelCache, contiguous_block_table
from .model import ForwardOutput, K3ForCausalLM
from .parallel import Collectives, LocalCollectives, ParallelContext, TorchDistributedCollectives

__all__ = ["Collectives", "ForwardBatch", "ForwardOutput", "K3ForCausalLM", "LocalCollectives", "ModelCache",
           "ParallelContext", "TorchDistributedCollectives", "contiguous_block_table"]
