#!/usr/bin/env python3
"""BENCHMARKS.md's history as plots: the k3-slice decode TPOT and TTFT on the H200 by date.

    python tools/plot_benchmarks.py                 # write docs/benchmarks-*.png
    python tools/plot_benchmarks.py --print         # print the series (no matplotlib needed)

BENCHMARKS.md is the record (one row per measurement, in markdown tables under headings); this
script only reads it. `parse_tables` returns every pipe table with the heading it sits under;
`series` picks the rows of the `k3_slice.py` benchmark (column `benchmark` or `bench`) and reads, from their free-text `figure`
column, the batch-1 decode TPOT ("TPOT at C=1 N ms", "decode [asynchronous] TPOT N ms", or the
first "TPOT N ms" of a `decode C=1` row) and the TTFT at 1K and 8K prompt tokens ("TTFT 1K /
8K[ / 32K] a / b", or the first "a / b" of a `TTFT 1K / 8K` row), one point per row. Rendering needs matplotlib: the `plots`
extra (`pip install 'k3[plots]'`); the tests check the parser only.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_NUM = r"(\d[\d,]*(?:\.\d+)?)"
# the batch-1 decode TPOT, most explicit wording first
_TPOT_C1 = (re.compile(rf"TPOT at C=1 {_NUM} ms"), re.compile(rf"decode (?:asynchronous )?TPOT {_NUM} ms"))
_TPOT_ANY = re.compile(rf"TPOT {_NUM} ms")
_TTFT = re.compile(rf"TTFT 1K / 8K(?: / 32K)? {_NUM} / {_NUM}")
_TWO_MS = re.compile(rf"{_NUM}(?: ms)? / {_NUM}")


@dataclass
class Table:
    """One markdown pipe table: the heading above it, its header cells and its rows."""

    heading: str
    header: list[str]
    rows: list[dict[str, str]] = field(default_factory=list)


def _cells(line: str) -> list[str]:
    body = line.strip()[1:]
    body = body[:-1] if body.endswith("|") else body
    return [c.strip() for c in re.split(r"(?<!\\)\|", body)]


def parse_tables(markdown: str) -> list[Table]:
    """Every pipe table of `markdown` (a header line, a |---| line, then rows), in order."""
    tables: list[Table] = []
    heading, lines, i = "", markdown.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif (line.startswith("|") and i + 1 < len(lines)
              and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+\s*", lines[i + 1].strip())):
            table = Table(heading, _cells(line))
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = _cells(lines[i])
                table.rows.append(dict(zip(table.header, cells + [""] * (len(table.header) - len(cells)))))
                i += 1
            tables.append(table)
            continue
        i += 1
    return tables


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def series(tables: list[Table], benchmark: str = "k3_slice.py") -> dict[str, list[tuple[str, float]]]:
    """(date, value) points of the `benchmark` rows: 'tpot_ms' (batch-1 decode), 'ttft_1k_ms',
    'ttft_8k_ms'; a row adds a point to each series its figure names."""
    out: dict[str, list[tuple[str, float]]] = {"tpot_ms": [], "ttft_1k_ms": [], "ttft_8k_ms": []}
    for table in tables:
        for row in table.rows:
            name = row.get("benchmark") or row.get("bench") or ""      # some sections call the column "bench"
            if benchmark not in name or not re.fullmatch(r"\d{4}-\d\d-\d\d", row.get("date", "")):
                continue
            figure = row.get("figure", "").replace("**", "")
            m = next((m for pattern in _TPOT_C1 if (m := pattern.search(figure))), None)
            if m is None and "decode C=1" in name:
                m = _TPOT_ANY.search(figure)
            if m:
                out["tpot_ms"].append((row["date"], _number(m.group(1))))
            m = _TTFT.search(figure) or ("TTFT 1K / 8K" in name and _TWO_MS.search(figure)) or None
            if m:
                out["ttft_1k_ms"].append((row["date"], _number(m.group(1))))
                out["ttft_8k_ms"].append((row["date"], _number(m.group(2))))
    return out


def render(points: dict[str, list[tuple[str, float]]], out_dir: Path) -> list[Path]:
    """One PNG per plot under `out_dir` (needs matplotlib: the `plots` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_benchmarks: matplotlib is not installed: pip install 'k3[plots]'")
    plots = (("benchmarks-tpot.png", "k3-slice decode TPOT at batch 1 (H200)", "ms", ("tpot_ms",)),
             ("benchmarks-ttft.png", "k3-slice TTFT (H200)", "ms", ("ttft_1k_ms", "ttft_8k_ms")))
    written = []
    for name, title, unit, keys in plots:
        fig, ax = plt.subplots(figsize=(7, 3.5), dpi=100)
        for key in keys:
            xs = list(range(len(points[key])))
            ax.plot(xs, [v for _, v in points[key]], marker="o", label=key.replace("_ms", "").replace("_", " "))
            ax.set_xticks(xs, [d[5:] for d, _ in points[key]], rotation=45, fontsize=7)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.set_xlabel("BENCHMARKS.md rows, in order (month-day)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name)
        plt.close(fig)
        written.append(out_dir / name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--benchmarks", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs")
    parser.add_argument("--print", action="store_true", help="print the series instead of plotting")
    args = parser.parse_args(argv)
    points = series(parse_tables(args.benchmarks.read_text()))
    if args.print:
        for key, values in points.items():
            print(key, " ".join(f"{d}:{v:g}" for d, v in values))
        return 0
    for path in render(points, args.out_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
