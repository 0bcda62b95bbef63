"""The figures issue 27 (NVIDIA performance II) tracks, and where each is read in bench/results.

Each `Figure` names the result files that hold it (file-name globs: only the runs that measure the
served configuration, not the experiment files that changed a kernel before timing it), an
extractor that returns the value from one file's JSON or None when the file lacks the field (a
schema that changed, a phase that did not run: the file is skipped, nothing is guessed), its unit,
its direction and the issue's goal and must-have bars. `bench/regression_table.py` turns them into
BENCHMARKS.md's regression table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

LOWER = "lower"
HIGHER = "higher"


@dataclass(frozen=True)
class Figure:
    """One tracked figure: where it is read, how it is compared, and the issue's bars."""

    name: str
    unit: str
    better: str                                   # LOWER or HIGHER
    file_globs: tuple[str, ...]                   # fnmatch patterns over bench/results file names,
                                                  # "{machine}" standing for h200 / h100 / cpu
    extract: Callable[[dict], float | None]       # one result (a run of a file) -> value or None
    goal: float | None = None
    must: float | None = None
    source: str = ""                              # the JSON field, for the table's notes

    def meets(self, value: float, bar: float | None) -> bool | None:
        """Whether `value` is at least as good as `bar` (None when the issue sets no such bar)."""
        if bar is None:
            return None
        return value <= bar if self.better == LOWER else value >= bar

    def is_better(self, a: float, b: float) -> bool:
        """Whether `a` is strictly better than `b` in this figure's direction."""
        return a < b if self.better == LOWER else a > b

    def globs_for(self, machine: str) -> tuple[str, ...]:
        """The file-name patterns of this figure's runs on one machine kind ("h200", "h100")."""
        return tuple(g.replace("{machine}", machine) for g in self.file_globs)


def results_of(document: Any) -> Iterator[dict]:
    """The results a file holds: the document itself, or each `runs[i].result` of a file that
    records several runs of one script in order (bench/results/k3_slice-h200-2026-11-29.json)."""
    if isinstance(document, dict) and isinstance(document.get("runs"), list):
        for run in document["runs"]:
            if isinstance(run, dict) and isinstance(run.get("result"), dict):
                yield run["result"]
    elif isinstance(document, dict):
        yield document


def _number(value: Any) -> float | None:
    """`value` as a float when it is a number (not a bool), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _k3_slice_decode(key: str, concurrency: int, field: str) -> Callable[[dict], float | None]:
    """k3_slice.py's nvidia `decode` / `decode_async` list: `field` of the entry at `concurrency`."""
    def extract(result: dict) -> float | None:
        entries = (result.get("nvidia") or {}).get(key)
        if not isinstance(entries, list):
            return None
        for entry in entries:
            if isinstance(entry, dict) and entry.get("concurrency") == concurrency:
                return _number(entry.get(field))
        return None
    return extract


def _k3_slice_ttft(tokens: int) -> Callable[[dict], float | None]:
    """k3_slice.py's nvidia `ttft_ms` at a prompt of `tokens` (JSON keys are strings)."""
    def extract(result: dict) -> float | None:
        ttft = (result.get("nvidia") or {}).get("ttft_ms")
        return _number(ttft.get(str(tokens))) if isinstance(ttft, dict) else None
    return extract


def _moe_fraction_of_floor(tokens: int) -> Callable[[dict], float | None]:
    """moe_mxfp4.py at T tokens: the weight-bytes floor over the served launch's CUDA-graph time
    (`roofline_us / k3_served_us`: what the nvidia platform serves, recorded since 2026-12-06; in
    older files `k3_default_us`, experts_forward's default launch, which was served then), in
    percent. Not `fraction_of_roofline`, which uses the best variant of the sweep, often one that
    is not served."""
    def extract(result: dict) -> float | None:
        entry = result.get(f"T{tokens}")
        if not isinstance(entry, dict):
            return None
        served = _number(entry.get("k3_served_us", entry.get("k3_default_us")))
        floor = _number(entry.get("roofline_us"))
        if floor is None or not served:
            return None
        return 100.0 * floor / served
    return extract


def _kda_prefill_conformant_8k(result: dict) -> float | None:
    """kda_prefill.py at B1 T8192: `triton_phases_ms`, k3's own two-phase Triton kernel, the chunked
    prefill that passes conformance and is served since the seventh session. Files before it lack
    the field (their `k3_ms` is fla-core's pipeline, which fails the bf16 model cases)."""
    entry = result.get("T8192_no_checkpoints")
    return _number(entry.get("triton_phases_ms")) if isinstance(entry, dict) else None


def _kda_decode_one_sequence(result: dict) -> float | None:
    """kda_decode.py at one sequence, "hkv" state rows: the served variant's CUDA-graph time (us)."""
    entry = result.get("hkv_N1")
    return _number(entry.get("k3_fused_default_graph_us")) if isinstance(entry, dict) else None


# each session's runs of the served configuration: its first `check` (before the session's changes),
# a second one where there was one, and the last one (no tag); the 32k-router, kda-chunked-torch,
# workload and 32k-prefix-ngram files ran experimental settings or one phase alone and are left out
K3_SLICE = ("k3_slice-{machine}-*.json", "k3_slice-first-{machine}-*.json", "k3_slice-second-{machine}-*.json")
# the main run of each session, the grouped-gemv runs of 2026-12-04, which time the served
# default in the same run (`k3_default_us`), and the served set's own runs (`served`, 2026-12-07); the fp16x2-no-convert, gemv-mma, row-split and
# prefill-dequant files changed the kernel before timing it and are left out
MOE = ("moe_mxfp4-{machine}-*.json", "moe_mxfp4-grouped-{machine}-*.json", "moe_mxfp4-grouped-k128-{machine}-*.json",
       "moe_mxfp4-served-{machine}-*.json")
# the main run of each session, and the seventh session's last call (split-variants: the served
# code, BENCHMARKS.md's 12.05 ms); launch-variants timed intermediate launch settings; the diag,
# torch-batched and tf32x3 files predate the field
KDA_PREFILL = ("kda_prefill-{machine}-*.json", "kda_prefill-split-variants-{machine}-*.json")

FIGURES: tuple[Figure, ...] = (
    Figure("k3-slice TPOT, 1 request (synchronous)", "ms", LOWER, K3_SLICE,
           _k3_slice_decode("decode", 1, "tpot_ms"), goal=6.0, must=6.5,
           source="nvidia.decode[concurrency=1].tpot_ms"),
    Figure("k3-slice TPOT, 1 request (asynchronous scheduling, the served default)", "ms", LOWER, K3_SLICE,
           _k3_slice_decode("decode_async", 1, "tpot_ms"), goal=6.0, must=6.5,
           source="nvidia.decode_async[concurrency=1].tpot_ms"),
    Figure("k3-slice decode throughput, 64 requests (synchronous)", "tok/s", HIGHER, K3_SLICE,
           _k3_slice_decode("decode", 64, "tokens_per_s"), goal=3500.0, must=2800.0,
           source="nvidia.decode[concurrency=64].tokens_per_s"),
    Figure("k3-slice decode throughput, 64 requests (asynchronous scheduling)", "tok/s", HIGHER, K3_SLICE,
           _k3_slice_decode("decode_async", 64, "tokens_per_s"), goal=3500.0, must=2800.0,
           source="nvidia.decode_async[concurrency=64].tokens_per_s"),
    Figure("MXFP4 MoE, T = 1, served launch", "% of weight-bytes floor", HIGHER, MOE,
           _moe_fraction_of_floor(1), goal=75.0, must=None,
           source="T1.roofline_us / T1.k3_served_us (k3_default_us in files before 2026-12-06)"),
    Figure("MXFP4 MoE, T = 16, served launch", "% of weight-bytes floor", HIGHER, MOE,
           _moe_fraction_of_floor(16), goal=70.0, must=55.0,
           source="T16.roofline_us / T16.k3_served_us (k3_default_us in files before 2026-12-06)"),
    Figure("MXFP4 MoE, T = 64, served launch", "% of weight-bytes floor", HIGHER, MOE,
           _moe_fraction_of_floor(64), goal=70.0, must=55.0,
           source="T64.roofline_us / T64.k3_served_us (k3_default_us in files before 2026-12-06)"),
    Figure("conformant KDA chunked prefill, 8K tokens", "ms a layer", LOWER, KDA_PREFILL,
           _kda_prefill_conformant_8k, goal=2.5, must=3.5,
           source="T8192_no_checkpoints.triton_phases_ms"),
    Figure("k3-slice TTFT, 8K prompt", "ms", LOWER, K3_SLICE,
           _k3_slice_ttft(8192), goal=400.0, must=None,
           source="nvidia.ttft_ms[8192]"),
    Figure("fused KDA decode, 1 sequence (CUDA graph)", "us a layer", LOWER,
           ("kda_decode-{machine}-*.json", "kda_decode-split-v-{machine}-*.json"),
           _kda_decode_one_sequence, goal=5.0, must=None,
           source="hkv_N1.k3_fused_default_graph_us"),
)
