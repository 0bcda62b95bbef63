"""Random weights drawn on the model's own device (`--load-format dummy`, as in vLLM).

For benchmarks of models too large to write and read as random checkpoints (k3-slice: 56B
parameters): every tensor of the checkpoint layout is drawn where its parameter lives, with
the scales of `random_init` (so the forward is as well conditioned as a random checkpoint's),
each rank drawing only its own shard and experts. The values depend on the device's
generator; use a written checkpoint where values must match across machines.
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from .random_init import random_tensor


def load_dummy_weights(model, *, seed: int = 0, progress: bool = True) -> int:
    """Fill every parameter region a checkpoint would fill (W4A16 experts: their packed planes,
    then dequantised as a loaded checkpoint's are); returns the number of elements drawn."""
    from .loader import dequantize_int4_experts

    specs = list(model.weight_specs())
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    drawn = 0
    with torch.no_grad():
        for template, param_name, spec in tqdm(specs, desc="drawing dummy weights", unit="tensor", file=sys.stderr,
                                               disable=not progress):
            param = tensors[param_name]
            dest = (slice(None), *spec.dest) if spec.stack else tuple(spec.dest or ())
            target = param[dest] if dest else param
            shape = ((target.shape[0],) if spec.stack else ()) + tuple(spec.local_shape)   # the checkpoint's
            drawn_tensor = random_tensor(template, shape, param.dtype, seed=seed, name=template, cfg=model.cfg,
                                         device=param.device)
            target.copy_(drawn_tensor.reshape(target.shape))
            drawn += target.numel()
    dequantize_int4_experts(model)
    return drawn
