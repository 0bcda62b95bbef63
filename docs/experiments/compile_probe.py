"""torch.compile(fullgraph=True) of decode-path reference ops and of a k3-tiny decode step on
the CPU: the proxy for graph capture (DESIGN.md, "Decisions"). A host synchronisation or a
data-dependent shape is a graph break, which fullgraph=True turns into an error.

    python docs/experiments/compile_probe.py        # in the k3 venv (torch 2.13) or the torch-xla one

Reuses the cases of xla_contract_probe.py; prints one JSON line per case.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from xla_contract_probe import kda_case, mla_case  # noqa: E402


def compiled(name, fn, args, kwargs):
    """args: a tuple, or a function returning fresh arguments (calls that write their inputs)."""
    fresh = args if callable(args) else (lambda: args)
    torch._dynamo.reset()
    start = time.perf_counter()
    try:
        out = torch.compile(fn, fullgraph=True)(*fresh(), **kwargs)
        expected = fn(*fresh(), **kwargs)
        a, b = (x[0] if isinstance(x, tuple) else x for x in (out, expected))
        row = {"case": name, "fullgraph": "ok", "max_abs_diff": (a.double() - b.double()).abs().max().item()}
    except Exception as e:
        row = {"case": name, "fullgraph": "error", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    row["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(row), flush=True)


def decode_step():
    """(fn, fresh_args): a k3-tiny fp32 decode step after a two-sequence prefill; the step
    writes the cache, so every call gets a copy of the prefilled one."""
    import copy
    import tempfile

    from k3.cache.pool import CachePool
    from k3.checkpoint.loader import load_checkpoint
    from k3.checkpoint.random_init import random_checkpoint
    from k3.checkpoint.writer import write_checkpoint
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.model.metadata import ForwardMetadata

    cfg = K3Config.preset("k3-tiny")
    model = K3ForCausalLM(cfg, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(tmp, cfg, random_checkpoint(cfg, seed=0))
        load_checkpoint(model, tmp, progress=False)
    table = torch.arange(2, 6, dtype=torch.int32).reshape(2, 2)             # pages after the 2 state rows
    cache = CachePool.for_model(model, 6, block_size=16).views
    model(ForwardMetadata.build([[1, 2, 3], [4, 5]], context_lens=[0, 0], state_indices=[0, 1],
                                block_table=table, page_size=16), cache)
    meta = ForwardMetadata.build([[6], [7]], context_lens=[3, 2], state_indices=[0, 1], block_table=table,
                                 page_size=16)
    return (lambda m, c: model(m, c).logits), (lambda: (meta, copy.deepcopy(cache)))


def main() -> int:
    from k3 import reference as ref

    print(json.dumps({"torch": torch.__version__}), flush=True)
    compiled("mla_decode N=4", ref.mla_decode, *mla_case(4))
    compiled("mla_decode N=4 fp8 cache", ref.mla_decode, *mla_case(4, fp8=True))
    compiled("kda_recurrent B=N=4 T=1 (no cu_seqlens)", ref.kda_recurrent, *kda_case(4, 1))
    compiled("kda_recurrent packed (cu_seqlens)", ref.kda_recurrent, *kda_case(4, 1, packed=True))
    g = torch.Generator().manual_seed(1)
    x, w, st = torch.randn(4, 1, 24, generator=g), torch.randn(24, 4, generator=g), torch.randn(4, 24, 3, generator=g)
    compiled("short_conv B=N=4 T=1 (no cu_seqlens)", ref.short_conv, (x, w), {"conv_state": st})
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(6)])
    args = (torch.randn(6, 16, generator=g), torch.randn(8, 24, 16, generator=g), torch.randn(8, 16, 12, generator=g),
            torch.rand(6, 2, generator=g), ids)
    compiled("experts_forward (host dispatch)", ref.experts_forward, args, {"activation": "silu"})
    compiled("experts_forward dense_dispatch", ref.experts_forward, args, {"activation": "silu",
                                                                          "dense_dispatch": True})
    fn, step_args = decode_step()
    compiled("k3-tiny decode step N=2 (model forward)", fn, step_args, {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
