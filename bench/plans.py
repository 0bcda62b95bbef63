"""The table of docs/planning.md: `k3 plan` for kimi-k3 and kimi-k3.1-pro on 8 / 16 / 32 x H200
and 8 x MI355X at max-model-len 1M and 128K. CPU only, no GPU, about five seconds.

    python3 bench/plans.py            # print the table
    python3 bench/plans.py --write    # put it into docs/planning.md between its markers

Each row is `k3 plan --preset MODEL COMMON --gpu-memory GIB --max-model-len N FLAGS --json`
through the CLI's own parser and report (`k3.cli.plan.report_for`), so a row is reproduced by
running that command; tests/unit/cache/test_topology_plan.py checks the doc equals this output.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from k3.cache.capacity import GIB

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "planning.md"
BEGIN, END = "<!-- plans.py: begin -->", "<!-- plans.py: end -->"

MODELS = ("kimi-k3", "kimi-k3.1-pro")
COMMON = ("--kv-cache-dtype", "fp8", "--index-cache-dtype", "fp8", "--gpu-memory-utilization", "0.9")
# (GPUs, --gpu-memory in GiB, topology flags): TP 8 within a node, DP across nodes, EP over all
HARDWARE = (
    ("8 x H200", "131.3", ("--tensor-parallel-size", "8", "--enable-expert-parallel")),
    ("16 x H200", "131.3", ("--tensor-parallel-size", "8", "--data-parallel-size", "2", "--enable-expert-parallel")),
    ("32 x H200", "131.3", ("--tensor-parallel-size", "8", "--data-parallel-size", "4", "--enable-expert-parallel")),
    ("8 x MI355X", "268.2", ("--tensor-parallel-size", "8", "--enable-expert-parallel")),
)
LENGTHS = ((1 << 20, "1M"), (128 * 1024, "128K"))


def plan(model: str, memory: str, flags: tuple[str, ...], max_model_len: int):
    """The CapacityReport `k3 plan` prints for this row."""
    from k3.cli.common import load_config
    from k3.cli.plan import add_arguments, report_for

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--preset", model, *COMMON, "--gpu-memory", memory,
                              "--max-model-len", str(max_model_len), *flags])
    return report_for(args, load_config(args))


def table() -> str:
    """The markdown the doc holds between BEGIN and END."""
    from k3.cli.plan import suggestion_line

    g = lambda n: f"{n / GIB:,.1f}"  # noqa: E731
    lines = [
        f"Every row: `k3 plan --preset MODEL {' '.join(COMMON)} --gpu-memory GIB --max-model-len N FLAGS` "
        "(add `--json` for every term). H200: 141 GB = 131.3 GiB; MI355X: 288 GB = 268.2 GiB. "
        "Weights and cache are per GPU; capacity per engine (one DP rank) and in total (x DP); "
        "`max-len reqs` is the concurrent max-length requests of one engine.",
        "",
        "| model | GPUs | flags | max-model-len | weights / GPU GiB (attention + experts + shared/dense + "
        "embed/lm_head + other) | experts / GPU | cache / GPU GiB | capacity tokens / engine | max-len reqs | "
        "capacity tokens total | fits | smallest fitting topology |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in MODELS:
        for gpus, memory, flags in HARDWARE:
            for length, label in LENGTHS:
                r = plan(model, memory, flags, length)
                w = r.weight_terms
                parts = " + ".join(g(x) for x in (w.attention, w.routed_experts, w.shared_dense,
                                                   w.embedding_lm_head, w.other))
                lines.append(
                    f"| {model} | {gpus} ({memory} GiB) | `{' '.join(flags)}` | {label} | "
                    f"{g(r.weight_bytes_per_gpu)} ({parts}) | {w.experts_per_rank} | {g(r.cache_bytes)} | "
                    f"{r.capacity_tokens:,} | {r.concurrent_max_len_requests} | {r.capacity_tokens_total:,} | "
                    f"{'yes' if r.fits else 'no'} | {'' if r.fits else '`' + suggestion_line(r.suggested) + '`'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"replace the table in {DOC.relative_to(ROOT)}")
    args = parser.parse_args()
    text = table()
    if not args.write:
        print(text)
        return
    doc = DOC.read_text()
    start, stop = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    DOC.write_text(doc[:start] + "\n" + text + "\n" + doc[stop:])
    print(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
