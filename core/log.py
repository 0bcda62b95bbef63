"""k3's logging: library modules log under the `k3` logger (`get_logger(__name__)`), never print().

On first use the `k3` logger gets one handler writing `k3: MESSAGE` lines to the current
`sys.stderr` (looked up at each record, so a redirected stderr is honoured), at the level
$K3_LOGGING_LEVEL names (DEBUG, INFO, WARNING, ERROR, CRITICAL or a number; default INFO),
and does not propagate to the root logger (as vLLM's `vllm` logger; a root handler would
print every line twice). K3_CONFIGURE_LOGGING=0 leaves the `k3` logger to the application: no
handler, propagating, the level left unset (Python's default shows warnings and errors).
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "k3"
LEVEL_ENV = "K3_LOGGING_LEVEL"
CONFIGURE_ENV = "K3_CONFIGURE_LOGGING"
FORMAT = "k3: %(message)s"

_configured = False


class StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever `sys.stderr` is when a record is written."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:   # StreamHandler.__init__ assigns it; the property wins
        pass


def level_from_env(value: str | None) -> int:
    """The logging level $K3_LOGGING_LEVEL names (None or empty: INFO); ValueError for a name
    that is not a level."""
    if not value:
        return logging.INFO
    if value.strip().lstrip("-").isdigit():
        return int(value)
    level = logging.getLevelName(value.strip().upper())
    if not isinstance(level, int):
        raise ValueError(f"{LEVEL_ENV}={value!r} is not a logging level (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    return level


def configure(env=os.environ) -> logging.Logger:
    """Set up the `k3` logger once (see the module); returns it. Called by get_logger."""
    global _configured
    logger = logging.getLogger(LOGGER_NAME)
    if _configured:
        return logger
    _configured = True
    if env.get(CONFIGURE_ENV, "1") == "0":
        return logger
    try:
        level = level_from_env(env.get(LEVEL_ENV))
        bad = None
    except ValueError as e:
        level, bad = logging.INFO, str(e)
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    if bad:
        logger.warning("%s; logging at INFO", bad)
    return logger


def get_logger(name: str) -> logging.Logger:
    """The logger of module `name` under `k3` (k3.engine.factory -> "k3.engine.factory"; a
    name outside the package is put under it)."""
    configure()
    if name != LOGGER_NAME and not name.startswith(LOGGER_NAME + "."):
        name = f"{LOGGER_NAME}.{name}"
    return logging.getLogger(name)
