"""uvicorn's access log with health and readiness polls at DEBUG: a load balancer or an
orchestrator asks /health and /ready every few seconds, which at INFO buried the requests
that matter. `install()` (idempotent) adds the filter to the `uvicorn.access` logger; with
`--log-level debug` the polls are logged again, marked DEBUG."""

from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"
PROBES = frozenset({"/health", "/ready"})


def _path(record: logging.LogRecord) -> str | None:
    """The request path of a uvicorn access record (its args: client, method, path, version, status)."""
    args = record.args
    if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
        return args[2].split("?", 1)[0]
    return None


class ProbesAtDebug(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or _path(record) not in PROBES:
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def install() -> None:
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, ProbesAtDebug) for f in logger.filters):
        logger.addFilter(ProbesAtDebug())
