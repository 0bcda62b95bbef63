"""`--load-format dummy`: every parameter region a checkpoint fills is drawn on the model's
device, with the random checkpoints' scales, so the forward is finite and well conditioned."""

import math

import torch

from k3.cache.pool import CachePool
from k3.checkpoint.dummy import load_dummy_weights
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.metadata import ForwardMetadata


def test_dummy_weights_fill_everything_and_run(tmp_path):
    for preset in ("k3.1-pro-tiny", "kimi-linear-tiny"):
        model = K3ForCausalLM(K3Config.preset(preset), dtype=torch.float32)
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                if t.is_floating_point():
                    t.fill_(float("nan"))
                else:
                    t.fill_(255)             # E8M0 NaN scale / all-ones codes
        assert load_dummy_weights(model, seed=1, progress=False) > 0
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point():
                assert not t.isnan().any(), f"{preset}: {name} was not drawn"
        cache = CachePool.for_model(model, 5, block_size=16).views            # a state row, then 4 pages
        meta = ForwardMetadata.build([list(range(1, 30))], context_lens=[0], state_indices=[0],
                                     block_table=torch.arange(1, 5, dtype=torch.int32)[None], page_size=16)
        with torch.no_grad():
            logits = model(meta, cache).logits
        assert logits.isfinite().all() and 1 < logits.std() < 10 * math.sqrt(model.cfg.hidden_size)
