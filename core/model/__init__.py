"""The K3 model graph (pure torch over the platform's kernels, tensor-parallel ready)."""

from .batch import contiguous_block_table
from .model import ForwardOutput, K3ForCausalLM, reference_kernels
from .parallel import (Collectives, DCPStats, DecodeContextParallel, ExpertParallel, LocalCollectives, ParallelContext,
                       TorchDistributedCollectives)

__all__ = ["Collectives", "DCPStats", "DecodeContextParallel", "ExpertParallel", "ForwardOutput", "K3ForCausalLM", "LocalCollectives", "ParallelContext",
           "TorchDistributedCollectives", "contiguous_block_table", "reference_kernels"]
