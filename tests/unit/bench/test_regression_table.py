"""bench/regression_table.py (issue 27's regression table) over synthetic result files written here,
and its extractors over the committed bench/results, so a schema change that breaks one is noticed."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("k3_bench_regression_table", ROOT / "bench" / "regression_table.py")
reg = sys.modules.setdefault("k3_bench_regression_table", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(reg)
figures = sys.modules["regression_figures"]        # imported by the script from bench/

TPOT = next(f for f in figures.FIGURES if f.source == "nvidia.decode[concurrency=1].tpot_ms")
MOE_T16 = next(f for f in figures.FIGURES if f.source.startswith("T16."))


def _k3_slice(tmp_path: Path, name: str, tpot_ms: float | None) -> None:
    """A k3_slice.py result file whose synchronous decode at 1 request took `tpot_ms` (None: no
    decode list at all, as in a run that stopped before the decode phase)."""
    nvidia = {"platform": "nvidia", "ttft_ms": {"1024": 150.0}}
    if tpot_ms is not None:
        nvidia["decode"] = [{"concurrency": 1, "tpot_ms": tpot_ms, "tokens_per_s": 1000 / tpot_ms},
                            {"concurrency": 64, "tpot_ms": 40.0, "tokens_per_s": 1600.0}]
    (tmp_path / name).write_text(json.dumps({"date": "x", "device": "NVIDIA H200", "nvidia": nvidia}))


def _moe(tmp_path: Path, name: str, served_us_at_t16: float | None) -> None:
    """A moe_mxfp4.py result file whose served launch at T=16 took `served_us_at_t16` over a
    100 us floor (None: the file has no T16 entry)."""
    doc = {"date": "x", "T1": {"roofline_us": 66.0, "k3_default_us": 132.0}}
    if served_us_at_t16 is not None:
        doc["T16"] = {"roofline_us": 100.0, "k3_default_us": served_us_at_t16, "fraction_of_roofline": 0.99}
    (tmp_path / name).write_text(json.dumps(doc))


def test_lower_is_better_newest_against_the_best_before_it(tmp_path):
    _k3_slice(tmp_path, "k3_slice-h200-2026-11-29.json", 9.0)
    _k3_slice(tmp_path, "k3_slice-h200-2026-11-29-s3.json", 6.9)      # the best, not the newest
    _k3_slice(tmp_path, "k3_slice-h200-2026-11-29-s3b.json", 7.2)     # after s3 (tag suffix)
    _k3_slice(tmp_path, "k3_slice-h200-2026-11-30-s10.json", 7.5)     # newest: s10 after s3 by date
    _k3_slice(tmp_path, "k3_slice-h200-2026-11-29-s9.json", 5.0)      # older date, best of all
    found = reg.measurements(TPOT, tmp_path, "h200")
    assert [m.file for m in found] == ["k3_slice-h200-2026-11-29.json", "k3_slice-h200-2026-11-29-s3.json",
                                       "k3_slice-h200-2026-11-29-s3b.json", "k3_slice-h200-2026-11-29-s9.json",
                                       "k3_slice-h200-2026-11-30-s10.json"]
    newest, best = reg.newest_and_previous_best(TPOT, found)
    assert (newest.value, newest.file, newest.date, newest.machine) == (7.5, "k3_slice-h200-2026-11-30-s10.json",
                                                                         "2026-11-30", "h200")
    assert (best.value, best.file) == (5.0, "k3_slice-h200-2026-11-29-s9.json")
    line = reg.row(TPOT, found)
    assert "+50.0% (worse)" in line and "<= 6: **no**" in line and "<= 6.5: **no**" in line


def test_higher_is_better_newest_against_the_best_before_it(tmp_path):
    _moe(tmp_path, "moe_mxfp4-h200-2026-11-29-s3.json", 400.0)        # 25%
    _moe(tmp_path, "moe_mxfp4-h200-2026-11-29-s4.json", 125.0)        # 80%, the best
    _moe(tmp_path, "moe_mxfp4-h200-2026-11-30-s6.json", 200.0)        # 50%
    _moe(tmp_path, "moe_mxfp4-h200-2026-12-01-s9.json", 160.0)        # newest, 62.5%
    newest, best = reg.newest_and_previous_best(MOE_T16, reg.measurements(MOE_T16, tmp_path, "h200"))
    assert newest.value == 62.5 and newest.file == "moe_mxfp4-h200-2026-12-01-s9.json"
    assert best.value == 80.0 and best.file == "moe_mxfp4-h200-2026-11-29-s4.json"
    line = reg.row(MOE_T16, reg.measurements(MOE_T16, tmp_path, "h200"))
    assert "-21.9% (worse)" in line and ">= 70: **no**" in line and ">= 55: **yes**" in line


def test_files_without_the_field_other_machines_and_experiments_are_skipped(tmp_path):
    _moe(tmp_path, "moe_mxfp4-h200-2026-11-29-s3.json", 200.0)
    _moe(tmp_path, "moe_mxfp4-h200-2026-11-30-s6.json", None)               # no T16: skipped
    _moe(tmp_path, "moe_mxfp4-row-split-h200-2026-12-01-s9.json", 100.0)    # an experiment file
    _moe(tmp_path, "moe_mxfp4-h100-2026-12-05.json", 101.0)                 # another machine kind
    (tmp_path / "moe_mxfp4-h200-2026-12-02-s10.json").write_text("{not json")
    _k3_slice(tmp_path, "k3_slice-h200-2026-11-29-s3.json", 8.0)
    _k3_slice(tmp_path, "k3_slice-h200-2026-11-30-s6.json", None)           # no decode list: skipped
    assert [m.file for m in reg.measurements(MOE_T16, tmp_path, "h200")] == ["moe_mxfp4-h200-2026-11-29-s3.json"]
    assert [m.file for m in reg.measurements(MOE_T16, tmp_path, "h100")] == ["moe_mxfp4-h100-2026-12-05.json"]
    assert [m.file for m in reg.measurements(TPOT, tmp_path, "h200")] == ["k3_slice-h200-2026-11-29-s3.json"]
    assert "none before it" in reg.row(TPOT, reg.measurements(TPOT, tmp_path, "h200"))


def test_a_sessions_first_and_second_calls_come_before_its_untagged_last(tmp_path):
    _k3_slice(tmp_path, "k3_slice-h200-2026-12-01-s9.json", 7.1)             # the session's last call
    _k3_slice(tmp_path, "k3_slice-second-h200-2026-12-01-s9.json", 7.0)
    _k3_slice(tmp_path, "k3_slice-first-h200-2026-12-01-s9.json", 7.2)
    _k3_slice(tmp_path, "k3_slice-32k-router-h200-2026-12-01-s9.json", 6.0)  # experimental: not read
    found = reg.measurements(TPOT, tmp_path, "h200")
    assert [m.value for m in found] == [7.2, 7.0, 7.1]
    newest, best = reg.newest_and_previous_best(TPOT, found)
    assert (newest.file, best.file) == ("k3_slice-h200-2026-12-01-s9.json", "k3_slice-second-h200-2026-12-01-s9.json")


def test_several_runs_in_one_file_are_ordered_within_it(tmp_path):
    runs = [{"note": "first", "result": {"nvidia": {"decode": [{"concurrency": 1, "tpot_ms": 14.0}]}}},
            {"note": "second", "result": {"nvidia": {"decode": [{"concurrency": 1, "tpot_ms": 15.0}]}}}]
    (tmp_path / "k3_slice-h200-2026-11-29.json").write_text(json.dumps({"runs": runs}))
    newest, best = reg.newest_and_previous_best(TPOT, reg.measurements(TPOT, tmp_path, "h200"))
    assert (newest.value, best.value) == (15.0, 14.0)


def test_a_figure_nobody_measured_prints_not_measured(tmp_path):
    _k3_slice(tmp_path, "k3_slice-h200-2026-11-29-s3.json", 8.0)            # no moe files at all
    text = reg.table(tmp_path, "h200")
    moe_rows = [line for line in text.splitlines() if line.startswith("| MXFP4 MoE")]
    assert len(moe_rows) == 3 and all("| not measured |" in line for line in moe_rows)
    assert "| 8 (2026-11-29" in text


def test_check_detects_a_stale_block_and_write_refreshes_it(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    _k3_slice(results, "k3_slice-h200-2026-11-29-s3.json", 8.0)
    benchmarks = tmp_path / "BENCHMARKS.md"
    benchmarks.write_text(f"# Benchmarks\n\nbefore\n\n{reg.BEGIN}\n| an old table |\n{reg.END}\n\nafter\n")
    paths = ["--results", str(results), "--benchmarks", str(benchmarks)]
    assert reg.main(["--check", *paths]) == 1
    assert reg.main(paths) == 0 and "| an old table |" in benchmarks.read_text()     # default: print only
    assert reg.main(["--write", *paths]) == 0
    text = benchmarks.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n\n") and text.endswith(f"{reg.END}\n\nafter\n")
    assert "| an old table |" not in text and "| 8 (2026-11-29" in text
    assert reg.main(["--check", *paths]) == 0
    _k3_slice(results, "k3_slice-h200-2026-11-30-s6.json", 7.0)                        # a new result
    assert reg.main(["--check", *paths]) == 1
    capsys.readouterr()


def test_each_machine_block_holds_its_own_machines_results(tmp_path, capsys):
    """--write fills the H200 block and, where BENCHMARKS.md has one, the H100's, each from its own
    machine's files; --check sees a new H100 result; --machine prints one table."""
    results = tmp_path / "results"
    results.mkdir()
    _k3_slice(results, "k3_slice-h200-2026-11-29-s3.json", 8.0)
    _k3_slice(results, "k3_slice-h100-2026-12-06-s21.json", 9.5)
    begin, end = reg.markers("h100")
    benchmarks = tmp_path / "BENCHMARKS.md"
    benchmarks.write_text(f"{reg.BEGIN}\n{reg.END}\n\nbetween\n\n{begin}\n| old |\n{end}\n")
    paths = ["--results", str(results), "--benchmarks", str(benchmarks)]
    assert reg.main(["--write", *paths]) == 0 and reg.main(["--check", *paths]) == 0
    text = benchmarks.read_text()
    h200, h100 = text.split("between")
    assert "| 8 (2026-11-29" in h200 and "9.5" not in h200 and "figure (H200)" in h200
    assert "| 9.5 (2026-12-06" in h100 and "| 8 (" not in h100 and "figure (H100)" in h100 and "| old |" not in h100
    _k3_slice(results, "k3_slice-h100-2026-12-07-s25.json", 9.25)
    assert reg.main(["--check", *paths]) == 1
    capsys.readouterr()
    assert reg.main(["--machine", "h100", *paths]) == 0
    printed = capsys.readouterr().out
    assert "figure (H100)" in printed and "figure (H200)" not in printed and "9.25" in printed


def test_every_figure_has_an_h200_measurement_in_the_committed_results():
    for figure in figures.FIGURES:
        found = reg.measurements(figure, reg.RESULTS, "h200")
        assert found, f"no H200 measurement of {figure.name!r}: did a result schema change?"
        assert all(m.machine == "h200" and m.file.startswith(figure.file_globs[0].split("-")[0]) for m in found)


def test_the_committed_benchmarks_table_is_current():
    assert reg.main(["--check"]) == 0, "run python bench/regression_table.py --write"


def test_the_served_launch_is_read_before_experts_forwards_default(tmp_path):
    """Since the promoted moe_experts_bf16, moe_mxfp4.py records what the platform serves
    (`k3_served_us`) beside experts_forward's default launch; the figure reads the served one
    where a file has it, else the default (older files, when the default was served)."""
    _moe(tmp_path, "moe_mxfp4-h200-2026-11-29-s3.json", 200.0)                  # default only: 50%
    doc = {"date": "x", "T16": {"roofline_us": 100.0, "k3_default_us": 400.0, "k3_served_us": 125.0}}
    (tmp_path / "moe_mxfp4-h200-2026-12-06-s21.json").write_text(json.dumps(doc))
    found = reg.measurements(MOE_T16, tmp_path, "h200")
    assert [m.value for m in found] == [50.0, 80.0]
