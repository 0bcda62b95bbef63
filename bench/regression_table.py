"""Issue 27's regression table: each tracked figure's newest measurement against the best before it.

    python bench/regression_table.py            # print the table
    python bench/regression_table.py --write    # replace the marked block in BENCHMARKS.md, print it
    python bench/regression_table.py --check    # exit 1 when BENCHMARKS.md's block is stale

The figures, their result files and the issue's bars are in `regression_figures.py`. Each result
file's name carries the machine kind (h200 / h100 / cpu), the date and sometimes a session tag
(`-s9`, `-s3b`); a measurement is ordered by (date, session, tag suffix, call within the session,
run within the file).
Only files of one machine kind are compared in a table: BENCHMARKS.md holds the H200's (the
issue's machine) and the H100's (where most sessions since 2026-12-05 ran), each between its own
markers; `--machine` picks one. A file that lacks a figure's field is skipped; a figure no file
holds prints "not measured".
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from regression_figures import FIGURES, LOWER, Figure, results_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BENCHMARKS = ROOT / "BENCHMARKS.md"
BEGIN = "<!-- regression-table:begin -->"           # the H200's block
END = "<!-- regression-table:end -->"
MACHINES = ("h200", "h100")                          # the blocks --write and --check keep, where present


def markers(machine: str) -> tuple[str, str]:
    """The begin / end markers of `machine`'s block in BENCHMARKS.md."""
    if machine == "h200":
        return BEGIN, END
    return f"<!-- regression-table-{machine}:begin -->", f"<!-- regression-table-{machine}:end -->"
# calls of one session tagged in the file name, in the order they ran; an untagged file is the
# session's last call (BENCHMARKS.md: "the first `check` of this session ... the last `check`")
_CALL_RANK = (("-first-", 0), ("-second-", 1))
_NAME = re.compile(r"-(?P<date>\d{4}-\d\d-\d\d)(?:-s(?P<session>\d+)(?P<suffix>[a-z]*))?(?:-[\w-]+)?\.json$")


@dataclass(frozen=True)
class Measurement:
    """One value of one figure, read from one run of one result file."""

    value: float
    file: str
    date: str
    machine: str
    order: tuple                                  # (date, session, suffix, call, file name, run)


def order_of(file_name: str, run_index: int) -> tuple | None:
    """The ordering key of a result file's run: (date, session number or 0, tag suffix, call within
    the session (first, second, then the untagged last), file name, run). The file name only breaks
    the remaining ties, such as two untagged files of one day."""
    match = _NAME.search(file_name)
    if match is None:
        return None
    call = next((rank for tag, rank in _CALL_RANK if tag in file_name), len(_CALL_RANK))
    return (match["date"], int(match["session"] or 0), match["suffix"] or "", call, file_name, run_index)


def measurements(figure: Figure, results_dir: Path, machine: str) -> list[Measurement]:
    """Every measurement of `figure` on `machine` in `results_dir`, oldest first. Files that are not
    JSON, carry no date, or lack the figure's field are skipped."""
    found = []
    for path in sorted(results_dir.glob("*.json")):
        if not any(fnmatch.fnmatchcase(path.name, g) for g in figure.globs_for(machine)):
            continue
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for index, result in enumerate(results_of(document)):
            order = order_of(path.name, index)
            value = figure.extract(result)
            if order is not None and value is not None:
                found.append(Measurement(value, path.name, order[0], machine, order))
    return sorted(found, key=lambda m: m.order)


def newest_and_previous_best(figure: Figure, found: list[Measurement]) -> tuple[Measurement | None, Measurement | None]:
    """The newest measurement and the best one strictly older than it (ties: the newer one)."""
    if not found:
        return None, None
    newest = max(found, key=lambda m: m.order)
    best = None
    for m in found:
        if m.order < newest.order and (best is None or not figure.is_better(best.value, m.value)):
            best = m
    return newest, best


def _value(value: float) -> str:
    """A figure's value with sensible precision (thousands separated)."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}" if abs(value) < 10 else f"{value:,.1f}"


def _bar(figure: Figure, value: float | None, bar: float | None) -> str:
    """'<= 6.5: no' for a bar and whether `value` meets it; '-' when the issue sets none."""
    if bar is None:
        return "-"
    sign = "<=" if figure.better == LOWER else ">="
    if value is None:
        return f"{sign} {bar:,g}"
    return f"{sign} {bar:,g}: **{'yes' if figure.meets(value, bar) else 'no'}**"


def _change(figure: Figure, newest: Measurement, best: Measurement | None) -> str:
    """The newest value against the previous best in percent, and whether that is better."""
    if best is None or best.value == 0:
        return "-"
    percent = 100.0 * (newest.value - best.value) / best.value
    if newest.value == best.value:
        return "0.0%"
    verdict = "better" if figure.is_better(newest.value, best.value) else "worse"
    return f"{percent:+.1f}% ({verdict})"


def row(figure: Figure, found: list[Measurement]) -> str:
    """One markdown row of the table."""
    direction = f"{figure.unit}, {figure.better} is better"
    newest, best = newest_and_previous_best(figure, found)
    if newest is None:
        cells = [figure.name, direction, "not measured", "-", "-",
                 _bar(figure, None, figure.goal), _bar(figure, None, figure.must)]
    else:
        today = f"{_value(newest.value)} ({newest.date}, [{newest.file}](bench/results/{newest.file}))"
        before = ("none before it" if best is None
                  else f"{_value(best.value)} ({best.date}, [{best.file}](bench/results/{best.file}))")
        cells = [figure.name, direction, today, before, _change(figure, newest, best),
                 _bar(figure, newest.value, figure.goal), _bar(figure, newest.value, figure.must)]
    return "| " + " | ".join(cells) + " |"


def table(results_dir: Path = RESULTS, machine: str = "h200", figures: tuple[Figure, ...] = FIGURES) -> str:
    """The markdown table of every figure on one machine kind."""
    lines = [f"| figure ({machine.upper()}) | unit, direction | newest (value, date, file) | previous best before it"
             " | change | issue goal: met | must-have: met |",
             "|---|---|---|---|---|---|---|"]
    lines += [row(f, measurements(f, results_dir, machine)) for f in figures]
    lines += ["", "Read from: " + "; ".join(f"{f.name}: `{f.source}`" for f in figures if f.source) + "."]
    return "\n".join(lines)


def replace_block(text: str, block: str, machine: str = "h200") -> str:
    """`text` with the lines between `machine`'s begin and end markers replaced by `block`."""
    begin, finish = markers(machine)
    start, end = text.find(begin), text.find(finish)
    if start < 0 or end < start:
        raise SystemExit(f"the markers {begin} ... {finish} are missing from BENCHMARKS.md")
    return text[:start + len(begin)] + "\n" + block + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    """Print the table; --write replaces BENCHMARKS.md's block; --check exits 1 when it is stale."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the marked block in BENCHMARKS.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if BENCHMARKS.md's block differs")
    parser.add_argument("--machine", default=None,
                        help="machine kind in the result file names (h200, h100); default: the H200 and every other "
                             "machine whose block BENCHMARKS.md holds")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the result files' folder")
    parser.add_argument("--benchmarks", type=Path, default=BENCHMARKS, help="the markdown file with the block")
    args = parser.parse_args(argv)
    current = args.benchmarks.read_text() if args.benchmarks.exists() else ""
    machines = [args.machine] if args.machine else [m for m in MACHINES if m == "h200" or markers(m)[0] in current]
    blocks = {machine: table(args.results, machine) for machine in machines}
    updated = current
    for machine, block in blocks.items():
        if args.check or args.write:
            updated = replace_block(updated, block, machine)
    if args.check:
        if updated != current:
            print(f"{args.benchmarks} regression table is stale: run python bench/regression_table.py --write",
                  file=sys.stderr)
            return 1
        return 0
    if args.write:
        args.benchmarks.write_text(updated)
    print("\n\n".join(blocks.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
