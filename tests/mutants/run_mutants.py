"""Mutation run: every one-line mutation of k3's model math (mutants.py) must change the tiny
models' output and then make a test fail.

    python tests/mutants/run_mutants.py [--only NAME ...] [--jobs 2] [--json OUT]

Run it with the oracle venv's python (.ci/peers.sh does), after the oracle tier has filled
`K3_ORACLE_CACHE`, so the kill tests compare against cached vLLM outputs instead of running
vLLM again. For each mutant, in a copy of the repository with the one line changed:
1. probe.py computes the float64 logits of k3-tiny, k3.1-pro-tiny and kimi-linear-tiny on a
   fixed prompt; a mutant whose largest change is below CHANGE_FLOOR (relative to the largest
   logit) changes nothing worth a test and is reported as `equivalent` (replace it);
2. the kill tests (KILL_TESTS, stopping at the first failure) must fail: otherwise the mutant
   `survived`.
Exit status 1 when any mutant survived or was equivalent, or when the unmutated tree fails its
own kill tests (then every kill would be meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from mutants import MUTANTS, Mutant, misplaced  # noqa: E402
from probe import PRESETS  # noqa: E402

# fast first: with -x a mutant stops at its first failing test. Two pytest runs: the oracle
# tier's conftest turns on the Triton interpreter for vLLM's kernels, which the unit tests'
# torch.compile checks must not see.
KILL_TESTS = (
    ("tests/oracles/test_vllm_k3.py::test_logits_match_vllm",
     "tests/oracles/test_transformers_kimi_linear.py::test_prompt_logprobs_match_transformers"),
    ("tests/unit/reference", "tests/unit/quant"),
)
CHANGE_FLOOR = 1e-6
COPIED = ("core", "platforms", "conformance", "tests", "docs", "pyproject.toml")


def make_tree(dest: Path) -> Path:
    """A copy of the sources importable as `k3` from dest / "site"."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        src = ROOT / name
        (shutil.copytree(src, dest / name, ignore=ignore) if src.is_dir() else shutil.copy(src, dest / name))
    (dest / "core" / "platforms").symlink_to("../platforms")
    (dest / "core" / "conformance").symlink_to("../conformance")
    (dest / "site").mkdir()
    (dest / "site" / "k3").symlink_to("../core")
    return dest


def apply(tree: Path, mutant: Mutant) -> None:
    path = tree / mutant.path
    text = (ROOT / mutant.path).read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise SystemExit(f"mutant {mutant.name}: the line to change occurs {count} times in {mutant.path}")
    path.write_text(text.replace(mutant.old, mutant.new))
    if mutant.new not in path.read_text():
        raise SystemExit(f"mutant {mutant.name}: {path} does not hold the mutated line")


def env_for(tree: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "site"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("K3_ORACLE_CACHE", str(ROOT / ".oracle-cache"))
    return env


def probe(tree: Path, checkpoints: Path, out: Path, mutated: Path | None = None) -> dict:
    """probe.py's logits under `tree`; checks that k3 came from the copy and, for a mutant, that
    the mutated file is the one Python imported."""
    subprocess.run([sys.executable, str(tree / "tests" / "mutants" / "probe.py"), str(checkpoints), str(out)],
                   env=env_for(tree), check=True, capture_output=True, text=True)
    result = torch.load(out)
    expected = str(tree / "site" / "k3")
    if not result["k3_file"].startswith(expected):
        raise SystemExit(f"the probe imported k3 from {result['k3_file']}, not the mutated copy under {expected}")
    if mutated is not None and str(mutated.resolve()) not in result["k3_modules"]:
        result["not_imported"] = True
    return result


def change(baseline: dict, mutated: dict) -> tuple[float, str]:
    """(largest relative logit change over the presets, where)."""
    worst, where = 0.0, ""
    for preset in PRESETS:
        got = mutated[preset]
        if isinstance(got, str):
            return float("inf"), f"{preset}: {got}"
        rel = float((got - baseline[preset]).abs().max() / baseline[preset].abs().max())
        if not got.isfinite().all():            # NaN (poisoned memory read) compares as no change: count it
            rel = float("inf")
        if rel > worst:
            worst, where = rel, preset
    return worst, where


def kill_tests(tree: Path) -> tuple[bool, str]:
    """(some kill test failed, the first failure's name)."""
    for group in KILL_TESTS:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "--tb=no", "-p", "no:cacheprovider",
                               *group], cwd=tree, env=env_for(tree), capture_output=True, text=True)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0:
            failed = [line.split(" - ")[0] for line in lines if line.startswith(("FAILED", "ERROR"))]
            return True, failed[0] if failed else (lines[-1] if lines else "")
    return False, lines[-1] if lines else ""


def run_one(mutant: Mutant, work: Path, checkpoints: Path, baseline: dict) -> dict:
    start = time.time()
    tree = make_tree(work / mutant.name)
    apply(tree, mutant)
    probed = probe(tree, checkpoints, work / f"{mutant.name}.pt", tree / mutant.path)
    # deterministic: the probe poisons memory nothing wrote (a mutant that reads it used to match the
    # baseline now and then, when the allocator returned the right values: CI 2026-12-02 and 12-04)
    changed, where = change(baseline, probed)
    if probed.get("not_imported"):
        where = f"{mutant.path} was never imported"
    row = {"name": mutant.name, "why": mutant.why, "change": changed, "changed_in": where}
    if changed < CHANGE_FLOOR:
        row["status"] = "equivalent"
    else:
        killed, by = kill_tests(tree)
        row.update(status="killed" if killed else "survived", killed_by=by)
    row["seconds"] = round(time.time() - start, 1)
    shutil.rmtree(tree, ignore_errors=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="mutant names (default: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the per-mutant rows here")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if problems := misplaced(chosen, ROOT):
        print("fix mutants.py first:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="k3-mutants-") as tmp:
        work = Path(tmp)
        checkpoints = work / "checkpoints"
        from k3.checkpoint.random_init import random_checkpoint
        from k3.checkpoint.writer import write_checkpoint
        from k3.config import K3Config

        for preset in PRESETS:
            cfg = K3Config.preset(preset)
            write_checkpoint(checkpoints / preset, cfg, random_checkpoint(cfg, seed=0), max_shard_bytes=256 * 1024)
        clean = make_tree(work / "unmutated")
        baseline = probe(clean, checkpoints, work / "baseline.pt")
        broken = [p for p in PRESETS if isinstance(baseline[p], str) or not baseline[p].isfinite().all()]
        if broken:
            print(f"the unmutated tree's logits are not finite for {broken} (a read of memory nothing wrote, which "
                  f"the probe poisons): fix that first", file=sys.stderr)
            return 1
        failed, by = kill_tests(clean)
        if failed:
            print(f"the unmutated tree fails its kill tests ({by}): fix that first", file=sys.stderr)
            return 1
        print(f"baseline ready in {time.time() - start:.0f} s; {len(chosen)} mutants, {args.jobs} at a time",
              flush=True)
        rows = []
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for row in pool.map(lambda m: run_one(m, work, checkpoints, baseline), chosen):
                rows.append(row)
                print(f"{row['status']:>10}  {row['name']:<34} change {row['change']:.1e} ({row['changed_in']}) "
                      f"{row.get('killed_by', '')}  [{row['seconds']} s]", flush=True)
    bad = [r for r in rows if r["status"] != "killed"]
    total = time.time() - start
    print(f"{len(rows) - len(bad)} of {len(rows)} mutants killed in {total:.0f} s"
          + (f"; not killed: {', '.join(r['name'] + ' (' + r['status'] + ')' for r in bad)}" if bad else ""))
    if args.json:
        args.json.write_text(json.dumps({"seconds": round(total), "mutants": rows}, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
