"""The startup report: what a started engine resolved, in one logged block.

`startup_report(engine)` gathers it as plain data from the engine's own parts (its cache plan,
scheduler, platform kernel set, decode graphs): the resolved max_model_len, the cache's capacity
in tokens and in concurrent max-length requests (`k3.cache.capacity.request_capacity`, the
arithmetic `k3 plan` uses), the block size, the kernel serving each kernel-table entry and the
plugin it comes from, the captured decode-graph batch sizes, whether the routed experts are held
dense (the expert cache). `log_startup_report` logs it as one INFO record of the
`k3.engine.startup_report` logger (`k3 serve` does, before it listens).
"""

from __future__ import annotations

from typing import Any

from k3.cache.capacity import request_capacity
from k3.log import get_logger
from k3.platform.reference import NAME as REFERENCE
from k3.plugin import KERNEL_TABLES

logger = get_logger(__name__)


def _kernel_name(fn) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{name}"


def kernels(platform) -> dict[str, dict[str, str]]:
    """"family.entry" -> {"provider": the plugin, "kernel": module.qualname of the callable}."""
    out = {}
    for table_cls in KERNEL_TABLES:
        table = getattr(platform.kernels, table_cls.FAMILY)
        for entry in table_cls.entries():
            key = f"{table_cls.FAMILY}.{entry}"
            out[key] = {"provider": platform.kernels.providers.get(key, REFERENCE),
                        "kernel": _kernel_name(getattr(table, entry))}
    return out


def startup_report(engine) -> dict[str, Any]:
    """The report of an LLMEngine (or of a distributed engine's local one, `.engine`)."""
    engine = getattr(engine, "engine", engine)
    plan, config = engine.plan, engine.config
    logical_block = engine.scheduler.config.block_size          # block x DCP
    concurrent, capacity = request_capacity(plan.token_rows, engine.max_model_len, logical_block)
    graphs = engine.runner.graphs
    if graphs is not None:
        graph_sizes: list[int] | str = list(graphs.buckets)
    elif config.enforce_eager:
        graph_sizes = "none (--enforce-eager)"
    elif engine.graph_capture_error:
        graph_sizes = f"none (capture failed: {engine.graph_capture_error})"
    else:
        graph_sizes = f"none (platform {engine.platform.name} does not capture)"
    return {
        "model": str(config.model), "platform": engine.platform.name, "device": str(engine.device),
        "max_model_len": engine.max_model_len, "block_size": plan.block_size,
        "cache_rows": plan.num_rows, "token_rows": plan.token_rows, "row_bytes": plan.layout.row_bytes,
        "capacity_tokens": capacity, "max_concurrent_requests": concurrent,
        "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
        "prefix_caching": engine.prefix_cache is not None, "async_scheduling": bool(engine.async_scheduling),
        "graph_batch_sizes": graph_sizes, "kernels": kernels(engine.platform),
        "expert_cache": _expert_cache(engine),
    }


def _expert_cache(engine) -> str:
    """The expert cache's decision (`k3.engine.expert_cache`) in words."""
    decision = getattr(engine, "expert_cache", None)
    return "off" if decision is None else f"{'on' if decision.on else 'off'} ({decision.reason})"


def format_report(report: dict[str, Any]) -> str:
    """The report as the lines `log_startup_report` logs."""
    r = report
    lines = [
        f"startup: {r['model']} on platform {r['platform']} ({r['device']})",
        f"  max_model_len {r['max_model_len']:,} tokens; block size {r['block_size']}",
        f"  cache: {r['cache_rows']:,} rows of {r['row_bytes']:,} bytes ({r['token_rows']:,} for tokens): "
        f"{r['capacity_tokens']:,} tokens, {r['max_concurrent_requests']:,} concurrent max-length requests",
        f"  scheduler: max_num_seqs {r['max_num_seqs']}, max_num_batched_tokens {r['max_num_batched_tokens']:,}, "
        f"prefix caching {'on' if r['prefix_caching'] else 'off'}, "
        f"async scheduling {'on' if r['async_scheduling'] else 'off'}",
        f"  expert cache: {r['expert_cache']}",
        "  decode graphs: " + (", ".join(map(str, r["graph_batch_sizes"])) if isinstance(r["graph_batch_sizes"], list)
                               else r["graph_batch_sizes"]),
        "  kernels:",
    ]
    lines += [f"    {key}: {k['kernel']} ({k['provider']})" for key, k in r["kernels"].items()]
    return "\n".join(lines)


def log_startup_report(engine) -> dict[str, Any] | None:
    """Log the report of `engine` (one INFO record) and return it; an engine the report cannot
    read (a part missing) gets a one-line warning and None instead: the report never stops a
    server from starting."""
    try:
        report = startup_report(engine)
    except Exception as e:  # noqa: BLE001 - a report, not a precondition
        logger.warning(f"startup report unavailable: {type(e).__name__}: {e}")
        return None
    logger.info(format_report(report))
    return report
