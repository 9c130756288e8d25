"""Structured events over the stdlib logger ``vllm.hotfix``.

We never configure logging or structlog globally: events go through whatever handlers vLLM
(or the host) put on ``vllm``. The logger is built lazily, after vLLM has configured
logging, so a ``dictConfig`` with ``disable_existing_loggers`` cannot silence it.
Hot paths use :func:`limited` so a repeating problem logs once per interval with a count.
"""
from __future__ import annotations

import logging
import os
import threading
import time

LOGGER_NAME = "vllm.hotfix"
#: seconds between two lines with the same rate-limit key.
RATE_LIMIT_S = 60.0

_bound = None
_bound_format = None
_lock = threading.Lock()
_limit_lock = threading.Lock()
_last_emitted = {}
_suppressed = {}
_once_seen = set()


def role() -> str:
    """The process's role as vLLM names it (``EngineCore_DP0``, ``VllmWorker-0``, ...)."""
    try:
        import multiprocessing

        return multiprocessing.current_process().name
    except Exception:
        return "unknown"


def _vllm_version() -> str:
    try:
        from hotfix import registry

        return registry.vllm_version() or "absent"
    except Exception:
        return "unknown"


def _process_fields(_logger, _method, event_dict):
    event_dict.setdefault("pid", os.getpid())  # per event: forked children get their own
    event_dict.setdefault("role", role())
    return event_dict


def _build(fmt: str):
    from hotfix import __version__, _deps

    stdlib_logger = logging.getLogger(LOGGER_NAME)
    structlog = _deps.structlog()
    if structlog is None:
        return None
    try:
        return _structlog_logger(structlog, stdlib_logger, fmt).bind(
            hotfix_version=__version__, vllm_version=_vllm_version()
        )
    except Exception:  # an odd structlog: fall back to plain lines rather than go silent
        return None


def _structlog_logger(structlog, stdlib_logger, fmt: str):
    renderer = (
        structlog.processors.JSONRenderer(sort_keys=True)
        if fmt == "json"
        else structlog.processors.KeyValueRenderer(key_order=["event"], drop_missing=True)
    )
    tracebacks = (
        structlog.processors.dict_tracebacks if fmt == "json" else structlog.processors.format_exc_info
    )
    return structlog.wrap_logger(
        stdlib_logger,
        wrapper_class=structlog.stdlib.BoundLogger,
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.processors.add_log_level,
            _process_fields,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            tracebacks,
            renderer,
        ],
    )


def _logger():
    global _bound, _bound_format
    from hotfix import config

    fmt = config.log_format()  # outside the lock: an invalid value logs through us
    with _lock:
        if _bound is None or _bound_format != fmt:
            _bound, _bound_format = _build(fmt), fmt
        return _bound


def emit(level: str, event: str, **fields) -> None:
    """Log one event; never raises (logging must not take the engine down)."""
    try:
        bound = _logger()
        if bound is not None:
            getattr(bound, level)(event, **fields)
            return
        text = " ".join([event] + [f"{k}={v!r}" for k, v in sorted(fields.items())])
        getattr(logging.getLogger(LOGGER_NAME), level)(text)
    except Exception:
        pass


def limited(key, level: str, event: str, **fields) -> None:
    """:func:`emit`, at most once per :data:`RATE_LIMIT_S` per key; counts what it dropped."""
    now = time.monotonic()
    with _limit_lock:
        last = _last_emitted.get(key)
        if last is not None and now - last < RATE_LIMIT_S:
            _suppressed[key] = _suppressed.get(key, 0) + 1
            return
        _last_emitted[key] = now
        dropped = _suppressed.pop(key, 0)
    if dropped:
        fields["suppressed"] = dropped
    emit(level, event, **fields)


def once(key, level: str, event: str, **fields) -> bool:
    """:func:`emit` the first time ``key`` is seen in this process; True if it did."""
    with _limit_lock:
        if key in _once_seen:
            return False
        _once_seen.add(key)
    emit(level, event, **fields)
    return True


def debug(event: str, **fields) -> None:
    emit("debug", event, **fields)


def info(event: str, **fields) -> None:
    emit("info", event, **fields)


def warning(event: str, **fields) -> None:
    emit("warning", event, **fields)


def error(event: str, **fields) -> None:
    emit("error", event, **fields)
