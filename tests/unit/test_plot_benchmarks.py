"""tools/plot_benchmarks.py's reader (the plotting needs matplotlib, the `plots` extra, and is
not tested): its tables and series against a sample written here and BENCHMARKS.md itself."""

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("k3_tools_plot_benchmarks", ROOT / "tools" / "plot_benchmarks.py")
plot = sys.modules.setdefault("k3_tools_plot_benchmarks", importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(plot)

SAMPLE = """# Benchmarks

| column | meaning |
|---|---|
| date | day |

## H200

| date | benchmark | machine | figure |
|---|---|---|---|
| 2026-11-29 | `bench/k3_slice.py` decode C=1 | H200 | TPOT 14.28 ms (70.0 tok/s) |
| 2026-11-29 | `bench/k3_slice.py` TTFT 1K / 8K | H200 | 297.7 ms / 2,010.6 ms |
| 2026-11-29 | `bench/kda_decode.py` N=1 | H200 | TPOT 1.0 ms |

### Later

| date | bench | machine | figure |
|---|---|---|---|
| 2026-12-02 | `bench/k3_slice.py --peer=` | H200 | decode TPOT at C=1 **7.08 ms synchronous**; TTFT 1K / 8K 165 / 666 ms; mean TPOT 23.8 ms |
"""


def test_tables_and_series_of_a_sample():
    tables = plot.parse_tables(SAMPLE)
    assert [t.heading for t in tables] == ["Benchmarks", "H200", "Later"]
    assert tables[1].header == ["date", "benchmark", "machine", "figure"] and len(tables[1].rows) == 3
    assert tables[2].rows[0]["bench"] == "`bench/k3_slice.py --peer=`"
    assert plot.series(tables) == {"tpot_ms": [("2026-11-29", 14.28), ("2026-12-02", 7.08)],
                                   "ttft_1k_ms": [("2026-11-29", 297.7), ("2026-12-02", 165.0)],
                                   "ttft_8k_ms": [("2026-11-29", 2010.6), ("2026-12-02", 666.0)]}


def test_every_dated_row_of_benchmarks_md_is_read():
    text = (ROOT / "BENCHMARKS.md").read_text()
    dated = [line for line in text.splitlines() if re.match(r"\| \d{4}-\d\d-\d\d \|", line)]
    rows = [r for t in plot.parse_tables(text) for r in t.rows if re.fullmatch(r"\d{4}-\d\d-\d\d", r.get("date", ""))]
    assert len(rows) == len(dated) > 50
    points = plot.series(plot.parse_tables(text))
    assert points["tpot_ms"][0] == ("2026-11-29", 14.28)          # the first k3-slice decode row
    assert len(points["ttft_1k_ms"]) == len(points["ttft_8k_ms"]) >= 5
    assert all(a < b for (_, a), (_, b) in zip(points["ttft_1k_ms"], points["ttft_8k_ms"]))
