"""Request logging (`k3 serve --enable-log-requests`): one INFO line per API request on the
`k3.serve.requests` logger, as it is admitted:

    request cmpl-3f..: model k3-tiny, 1 prompt(s), 150 prompt tokens, params {max_tokens: 4, temperature: 0}

The params are the sampling parameters that differ from their defaults, scalars as given and
anything larger (stop strings, token lists, a structured-output spec) as its size or kind only.
The prompt text is never logged unless `max_log_len` > 0 (`--max-log-len N`): then its first
N characters (of the first prompt's first N tokens, decoded) are appended.
"""

from __future__ import annotations

import dataclasses

from k3.log import get_logger

logger = get_logger("k3.serve.requests")


def params_summary(params) -> str:
    """The non-default fields of a SamplingParams, large values by size or kind only."""
    items = []
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        if value == default or (value in (None, [], {}) and default in (None, [], {})):
            continue
        if isinstance(value, (bool, int, float)) or value is None:
            shown = repr(value)
        elif isinstance(value, (list, tuple, dict, set, str)):
            shown = f"<{len(value)}>"
        else:
            shown = f"<{type(value).__name__}>"
        items.append(f"{f.name}: {shown}")
    return "{" + ", ".join(items) + "}"


def log_request(request_id: str, model: str, prompts: list[list[int]], params, *, tokenizer=None,
                max_log_len: int = 0) -> None:
    """Log one admitted request (see the module); prompts: each prompt's token ids."""
    if not logger.isEnabledFor(20):
        return
    line = (f"request {request_id}: model {model}, {len(prompts)} prompt(s), "
            f"{sum(len(p) for p in prompts)} prompt tokens, params {params_summary(params)}")
    if max_log_len > 0 and prompts:
        ids = prompts[0][:max_log_len]
        text = tokenizer.decode(ids) if tokenizer is not None else str(ids)
        line += f", prompt {text[:max_log_len]!r}"
    logger.info(line)
