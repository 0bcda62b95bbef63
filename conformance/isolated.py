"""Running one conformance item in a process of its own (a platform's `[run] isolate` option in
its conformance.toml, `k3.conformance.expectations.run_options`).

A platform whose runtime cannot take many model runs in one process (torch-xla on PJRT CPU
aborts inside `torch_xla.sync` after several engine runs) names those cases; `run_isolated`
then starts `python -m k3.conformance.isolated`, which selects the same platform, runs the one
item with the usual runner and writes its outcome as JSON; the parent reads it back. A child
that dies (a signal, an abort) or outlives the [run] timeout_s is the item's failure, with its
exit status (or the timeout) and the end of its output as the message, and the run goes on with
the next item. A case that skips itself in the child (pytest.skip, a capability reason) is
skipped in the parent with the same reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .compare import Outcome, OutputResult
from .registry import Tolerance

TAIL = 2000          # characters of a crashed child's output kept in the message


def run_isolated(ctx, item) -> Outcome:
    """`item`'s outcome, computed by `run_item` in a child process on ctx's platform (its
    scratch directory shared, so the tiny checkpoints are written once; the [run] env set in
    its environment)."""
    with tempfile.TemporaryDirectory(prefix="k3-isolated-", dir=ctx.workdir) as tmp:
        out = Path(tmp) / "outcome.json"
        cmd = _command(ctx, item, out)
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, **ctx.isolate_env}, timeout=ctx.isolate_timeout_s)
        except subprocess.TimeoutExpired as e:
            tail = _text(e.output)[-TAIL:].strip().replace("\n", " | ")
            return Outcome([OutputResult("process", "isolated", False,
                                         message=f"did not finish in {ctx.isolate_timeout_s:g} s (the platform's "
                                                 f"[run] timeout_s); its process was killed: {tail}")])
        if proc.returncode != 0 or not out.is_file():
            tail = proc.stdout[-TAIL:].strip().replace("\n", " | ")
            return Outcome([OutputResult("process", "isolated", False,
                                         message=f"the item's own process exited with status {proc.returncode}: "
                                                 f"{tail}")])
        data = json.loads(out.read_text())
    if "skipped" in data:                       # the case skipped itself in the child (a capability reason)
        import pytest

        pytest.skip(data["skipped"])
    outcome = outcome_from_dict(data)
    if ctx.isolate_env:
        outcome.notes.append("its environment from [run] env: " + ", ".join(f"{k}={v}" for k, v in ctx.isolate_env.items()))
    return outcome


def _command(ctx, item, out: Path) -> list[str]:
    return [sys.executable, "-m", "k3.conformance.isolated", "--platform", ctx.platform.name, "--item", item.id,
            "--workdir", str(ctx.workdir), "--out", str(out)]


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def outcome_from_dict(data: dict) -> Outcome:
    """The inverse of `Outcome.to_dict` (each output's fields), numbers kept as written."""
    def num(x):
        return float(x) if isinstance(x, str) else x

    outputs = [OutputResult(o["name"], o["kind"], o["passed"], num(o["error_ratio"]), num(o["max_abs_error"]),
                            Tolerance(o["tolerance"]["ratio"], o["tolerance"]["floor"]) if o["tolerance"] else None,
                            o["message"]) for o in data["outputs"]]
    return Outcome(outputs, list(data["notes"]) + ["ran in its own process (the platform's [run] isolate option)"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", required=True)
    parser.add_argument("--item", required=True, help="the item's id, case/shape/dtype")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from k3.platform import select_platform

    from .registry import items
    from .runner import RunContext, run_item

    item = next((i for i in items("full") if i.id == args.item), None)
    if item is None:
        print(f"no conformance item {args.item!r}", file=sys.stderr)
        return 2
    ctx = RunContext(select_platform(args.platform), workdir=Path(args.workdir))
    try:
        outcome = run_item(ctx, item)
    except BaseException as e:
        if type(e).__name__ != "Skipped":       # pytest.skip's exception: the parent skips the item with it
            raise
        Path(args.out).write_text(json.dumps({"skipped": str(getattr(e, "msg", e))}))
        return 0
    Path(args.out).write_text(json.dumps(outcome.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
