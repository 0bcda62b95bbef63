"""One rank of the collectives check: `python -m k3.conformance.dist_worker ...`.

Selects the platform, joins a process group with the platform's dist backend (gloo on the
CPU), and for each requested item runs the platform's `collectives()` and plain
torch.distributed on the same seeded per-rank input (all_to_all_single: its reference is built
from every rank's seeded input, without communication). Saves {item id: {"got", "want", "input",
"provider"} or {"error"}} to OUT/rank{R}.pt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _plain(op: str, x: torch.Tensor, dim: int) -> torch.Tensor:
    if op == "all_reduce":
        y = x.clone()
        dist.all_reduce(y)
        return y
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def _a2a_input(spec: dict, rank: int, world: int) -> tuple[torch.Tensor, list[int] | None, list[int] | None]:
    """all_to_all_single: rank `rank`'s seeded input and its (output, input) split sizes;
    spec["splits"][src][dst] rows go from src to dst (None: spec["rows"] rows, equal pieces)."""
    splits = spec.get("splits")
    rows = sum(splits[rank]) if splits else spec["rows"]
    g = torch.Generator().manual_seed(spec["seed"] + 7919 * rank)
    x = torch.randn([rows, *spec["row_shape"]], generator=g, dtype=torch.float64).to(getattr(torch, spec["dtype"]))
    if not splits:
        return x, None, None
    return x, [splits[src][rank] for src in range(world)], list(splits[rank])


def _a2a_reference(spec: dict, rank: int, world: int) -> torch.Tensor:
    """What rank `rank` must receive, from every rank's seeded input (no communication)."""
    pieces = []
    for src in range(world):
        x, _, sent = _a2a_input(spec, src, world)
        sent = sent or [x.shape[0] // world] * world
        pieces.append(x[sum(sent[:rank]): sum(sent[:rank + 1])])
    return torch.cat(pieces)


def _all_to_all(spec: dict, collectives, rank: int, world: int, device) -> dict:
    x, out_splits, in_splits = _a2a_input(spec, rank, world)
    x = x.to(device)
    if spec.get("device_splits") and out_splits is not None:
        out_splits, in_splits = (torch.tensor(s, device=device) for s in (out_splits, in_splits))
    provider = next((b.name for b in collectives.backends
                     if hasattr(b, "all_to_all_single") and b.accepts("all_to_all_single", x)), "none")
    got = collectives.all_to_all_single(x, out_splits, in_splits)
    return {"got": got.cpu(), "want": _a2a_reference(spec, rank, world), "input": x.cpu(), "provider": provider}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="k3.conformance.dist_worker")
    parser.add_argument("--platform", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init", required=True, help="file:// rendezvous URL")
    parser.add_argument("--items", required=True, help="JSON list of {id, op, shape, dtype, dim, seed}")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from k3.platform import select_platform

    platform = select_platform(args.platform)
    device = torch.device(platform.info.device)
    if device.type != "cpu":
        device = torch.device(device.type, args.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
    dist.init_process_group(platform.capabilities.dist_backend, init_method=args.init, rank=args.rank,
                            world_size=args.world)
    collectives = platform.collectives()
    results = {}
    for spec in json.loads(Path(args.items).read_text()):
        if spec["op"] == "all_to_all_single":
            try:
                results[spec["id"]] = _all_to_all(spec, collectives, args.rank, args.world, device)
            except Exception as e:  # reported per item, as below
                results[spec["id"]] = {"error": f"{type(e).__name__}: {e}"}
            continue
        g = torch.Generator().manual_seed(spec["seed"] + 7919 * args.rank)
        x = torch.randn(spec["shape"], generator=g, dtype=torch.float64).to(getattr(torch, spec["dtype"])).to(device)
        op, dim = spec["op"], spec.get("dim", 0)
        want = _plain(op, x, dim).cpu()
        try:
            provider = next((b.name for b in collectives.backends if b.accepts(op, x)), "none")
            got = collectives.all_reduce(x) if op == "all_reduce" else collectives.all_gather(x, dim)
            results[spec["id"]] = {"got": got.cpu(), "want": want, "input": x.cpu(), "provider": provider}
        except Exception as e:  # reported per item (a one-sided failure hangs: the parent times out)
            results[spec["id"]] = {"error": f"{type(e).__name__}: {e}"}
    torch.save(results, Path(args.out) / f"rank{args.rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
