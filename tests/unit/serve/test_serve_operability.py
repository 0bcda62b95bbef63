"""Operability of `k3 serve`: the startup report's figures (against the cache plan's own
arithmetic), request logging and its switch, $K3_LOGGING_LEVEL, no print() in library code,
and the warning for a server listening beyond loopback without an API key."""

from __future__ import annotations

import ast
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import pytest

from k3.cli.exposure import exposure_warning, is_loopback, listen_host
from k3.cli.main import build_parser
from k3.engine.startup_report import log_startup_report
from k3.log import level_from_env
from k3.plugin import KERNEL_TABLES
from k3.serve import build_app

from serve_support import MAX_MODEL_LEN, MODEL, LiveServer

ROOT = Path(__file__).parents[3]


@pytest.fixture
def k3_records(caplog):
    """caplog on the `k3` logger (which does not propagate to the root logger caplog watches)."""
    logger = logging.getLogger("k3")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="k3")
    yield caplog
    logger.removeHandler(caplog.handler)


def test_startup_report(engine, k3_records):
    report = log_startup_report(engine)
    e = engine.engine
    plan = e.plan
    # the cache plan's arithmetic: a max-length request takes ceil(len / block) rows + 1 state row
    per_request = math.ceil(MAX_MODEL_LEN / plan.block_size) + 1
    concurrent = plan.token_rows // per_request
    assert concurrent >= 1
    assert report["max_model_len"] == MAX_MODEL_LEN == e.scheduler.config.max_model_len
    assert report["block_size"] == plan.block_size and report["cache_rows"] == plan.num_rows
    assert report["max_concurrent_requests"] == concurrent
    assert report["capacity_tokens"] == (plan.token_rows - concurrent) * plan.block_size
    assert report["graph_batch_sizes"].startswith("none")          # the reference platform captures nothing
    entries = {f"{t.FAMILY}.{entry}" for t in KERNEL_TABLES for entry in t.entries()}
    assert set(report["kernels"]) == entries
    assert report["kernels"]["kda.chunked"]["provider"] == "reference"
    [record] = [r for r in k3_records.records if r.name == "k3.engine.startup_report"]
    text = record.getMessage()
    assert f"max_model_len {MAX_MODEL_LEN:,} tokens" in text
    assert f"{report['capacity_tokens']:,} tokens, {concurrent:,} concurrent max-length requests" in text
    assert all(f"    {key}: " in text for key in entries)


def test_request_log(engine, k3_records):
    app = build_app(engine, served_model_name=MODEL, log_requests=True)
    prompt = "secret words here"
    n = len(engine.tokenizer.encode(prompt, allow_special=False))
    with LiveServer(app) as server:
        def send():
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            lines = [r.getMessage() for r in k3_records.records if r.name == "k3.serve.requests"]
            k3_records.clear()
            return lines
        [line] = send()
        assert line.startswith("request cmpl-") and f"1 prompt(s), {n} prompt tokens" in line, line
        assert "max_tokens: 2" in line and "temperature: 0" in line and "secret" not in line, line
        app.state.k3.max_log_len = 6                 # --max-log-len 6: the prompt's first 6 characters
        [line] = send()
        assert line.endswith(f"prompt {engine.tokenizer.decode(engine.tokenizer.encode(prompt, allow_special=False)[:6])[:6]!r}")
        app.state.k3.log_requests = False
        assert send() == []
    parser = build_parser()
    assert parser.parse_args(["serve", "m", "--enable-log-requests"]).log_requests is True
    assert parser.parse_args(["serve", "m", "--disable-log-requests"]).log_requests is False
    assert parser.parse_args(["serve", "m"]).log_requests is False


def test_logging_level_from_the_environment():
    assert (level_from_env(None), level_from_env("debug"), level_from_env("WARNING"), level_from_env("15")) == (
        logging.INFO, logging.DEBUG, logging.WARNING, 15)
    with pytest.raises(ValueError, match="K3_LOGGING_LEVEL"):
        level_from_env("loud")
    code = "from k3.log import get_logger; log = get_logger('t'); log.info('hidden'); log.warning('shown')"
    env = {**os.environ, "K3_LOGGING_LEVEL": "WARNING"}
    env.pop("K3_CONFIGURE_LOGGING", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stderr == "k3: shown\n"


def test_no_print_in_library_code():
    """print() only in the CLI (its output is the interface); library code logs."""
    found = []
    for path in (ROOT / "core").rglob("*.py"):
        rel = path.relative_to(ROOT / "core")
        if rel.parts[0] == "cli" or rel.name == "compact_sample.py":     # the latter is sample text
            continue
        source = path.read_text()
        if "print(" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                found.append(f"{rel}:{node.lineno}")
    assert found == []


def test_host_default_and_exposure_warning():
    assert build_parser().parse_args(["serve", "m"]).host is None and listen_host(None) == "0.0.0.0"
    assert [is_loopback(h) for h in (None, "0.0.0.0", "::", "127.0.0.1", "::1", "localhost", "10.1.2.3")] == [
        False, False, False, True, True, True, False]
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning(None, ["k"]) is None
    assert "every interface without --api-key" in exposure_warning(None, None)
    assert "10.1.2.3 without --api-key" in exposure_warning("10.1.2.3", None)
    # the warning in a served process: tests/unit/serve/test_serve_cli.py::test_serve_process_end_to_end
