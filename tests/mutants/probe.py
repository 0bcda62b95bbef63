"""Float64 logits of the tiny presets' fixed prompts, for run_mutants.py.

    python probe.py CHECKPOINTS_DIR OUT.pt

CHECKPOINTS_DIR holds one checkpoint per preset (named as the preset); OUT.pt gets
{preset: logits [T, V]} plus "k3_file" (which k3 was imported, so the runner can check it is the
mutated copy) and "k3_modules" (the files of every k3 module imported). A preset whose model fails to build or run maps to the error text.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

PRESETS = ("k3-tiny", "k3.1-pro-tiny", "kimi-linear-tiny")


def prompt() -> list[int]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 384, (36,), generator=g).tolist()


def logits(checkpoint: Path) -> torch.Tensor:
    from k3.cache.pool import CachePool
    from k3.checkpoint.loader import load_model
    from k3.model import contiguous_block_table
    from k3.model.metadata import ForwardMetadata

    model = load_model(checkpoint, dtype=torch.float64, progress=False)
    ids, page = prompt(), 16
    pages = -(-len(ids) // page)
    cache = CachePool.for_model(model, 1 + pages, block_size=page).views      # a state row, then the pages
    meta = ForwardMetadata.build([ids], context_lens=[0], state_indices=[0],
                                 block_table=contiguous_block_table(1, pages) + 1, page_size=page, all_logits=True)
    return model(meta, cache).logits


def main() -> None:
    # uninitialised memory reads as NaN (torch fills empty tensors in deterministic mode): a mutant
    # that makes the model read a buffer nothing wrote then always shows, instead of matching the
    # baseline whenever the allocator hands back memory that happens to hold the right values
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    import k3

    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    result: dict = {"k3_file": k3.__file__}
    for preset in PRESETS:
        try:
            result[preset] = logits(root / preset)
        except Exception as e:  # noqa: BLE001 - a mutant that breaks the model is reported as such
            result[preset] = f"{type(e).__name__}: {e}"
    result["k3_modules"] = sorted(str(Path(m.__file__).resolve()) for name, m in sys.modules.items()
                                  if name.startswith("k3") and getattr(m, "__file__", None))
    torch.save(result, out)


if __name__ == "__main__":
    main()
