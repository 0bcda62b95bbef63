"""One k3-tiny decode step on the tpu platform, sharded over an SPMD mesh or on one device
(run by test_spmd.py: sharded in a child process with 4 virtual PJRT CPU devices, unsharded
in the test's own process). `python spmd_child.py OUT.pt` writes the sharded logits and a
summary of the lowered HLO's shardings."""

from __future__ import annotations

import json
import os
import sys

import torch

PAGE, ROWS, SEQS = 16, 8, 4


def decode_logits(ckpt: str, shard: bool):
    """Logits [SEQS, V] (on the CPU) of one decode step of fresh sequences; with `shard`, the
    weights annotated by `k3.platforms.tpu.spmd` over every device, and the HLO summary."""
    import torch_xla

    from k3.cache.pool import CachePool
    from k3.checkpoint.loader import load_checkpoint
    from k3.config import K3Config
    from k3.model.metadata import ForwardMetadata
    from k3.platform import select_platform

    tpu = select_platform("tpu")
    model = tpu.build_model(K3Config.from_pretrained(ckpt), dtype=torch.float32)
    load_checkpoint(model, ckpt, progress=False)
    tpu.process_weights(model)
    model.model.fold_weights()
    hlo = {}
    if shard:
        from k3.platforms.tpu import spmd

        hlo["sharded"] = sorted(spmd.shard_model(model, spmd.mesh()))
    pool = CachePool.for_model(model, ROWS, block_size=PAGE, platform=tpu)
    ids = [[(29 * i + 3) % model.cfg.vocab_size] for i in range(SEQS)]
    table = torch.arange(SEQS, dtype=torch.int32)[:, None] + SEQS          # pages after the state rows
    meta = ForwardMetadata.build(ids, context_lens=[0] * SEQS, state_indices=list(range(SEQS)), block_table=table,
                                 page_size=PAGE, device=torch_xla.device())
    with torch.no_grad():
        logits = model(meta, pool.views, tap_layers=()).logits
    if shard:
        text = torch_xla._XLAC._get_xla_tensors_hlo([logits])
        hlo["annotations"] = text.count("sharding={devices=")
        hlo["collectives"] = {op: text.count(op) for op in ("all-reduce", "all-gather", "reduce-scatter")}
        hlo["devices"] = len(torch_xla.runtime.local_runtime_devices()) if hasattr(torch_xla.runtime,
                                                                                  "local_runtime_devices") else None
    return logits.cpu(), hlo


if __name__ == "__main__":
    import torch_xla.runtime as xr

    xr.use_spmd()
    logits, hlo = decode_logits(sys.argv[2], shard=True)
    hlo["device_count"] = xr.global_runtime_device_count()
    torch.save(logits, sys.argv[1])
    print("::: spmd", json.dumps(hlo))
    sys.stdout.flush()
    os._exit(0)
