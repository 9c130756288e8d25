"""Structured events over the stdlib logger ``vllm.hotfix``.

We never configure logging or structlog globally: events go through whatever handlers vLLM
(or the host) put on ``vllm``. The logger is built lazily, after vLLM has configured
logging, so a ``dictConfig`` with ``disable_existing_loggers`` cannot silence it.
Hot paths use :func:`limited` so a repeating problem logs once per interval with a count.
Every map here is bounded (H3): keys are kinds of problems, never request ids, and the rate
limiter and the once-set have caps besides.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import OrderedDict

from hotfix import forksafe

LOGGER_NAME = "vllm.hotfix"
#: seconds between two lines with the same rate-limit key.
RATE_LIMIT_S = 60.0

_bound = None
_bound_format = None
_lock = threading.Lock()
_limit_lock = threading.Lock()
forksafe.renew_in_child(sys.modules[__name__], "_lock")
forksafe.renew_in_child(sys.modules[__name__], "_limit_lock")


def role() -> str:
    """The process's role as vLLM names it (``EngineCore_DP0``, ``VllmWorker-0``, ...)."""
    try:
        import multiprocessing

        return multiprocessing.current_process().name
    except Exception:
        return "unknown"


def _vllm_version() -> str:
    try:
        from hotfix import fingerprint

        return fingerprint.vllm_version() or "absent"
    except Exception:
        return "unknown"


def _process_fields(_logger, _method, event_dict):
    event_dict.setdefault("pid", os.getpid())  # per event: forked children get their own
    event_dict.setdefault("role", role())
    return event_dict


def _build(fmt: str):
    from hotfix import _deps
    from hotfix._version import __version__

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


def _console_until_told() -> str:
    return "console"


_format_of_this_process = _console_until_told  # the config hands in its reader (read_format_with)


def read_format_with(read_format) -> None:
    """``read_format()`` gives ``HOTFIX_LOG_FORMAT``'s value: handed in by the config layer,
    which logs through us (a bad value), so that we never import it."""
    global _format_of_this_process
    _format_of_this_process = read_format


def _logger():
    global _bound, _bound_format

    fmt = _format_of_this_process()  # outside the lock: an invalid value logs through us
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


class _Window:
    __slots__ = ("start", "suppressed", "level", "event", "latest")

    def __init__(self, start: float) -> None:
        self.start = start
        self.suppressed = 0  # lines of this key dropped since ``start``
        self.level = self.event = None
        self.latest = None  # fields of the last dropped line (its req_id, ...)


class RateLimiter:
    """At most one line per key per ``interval``, with a cap on the keys it remembers.

    Lifecycle of a window: the first line of a key opens it (and is printed); later lines of
    that key inside it are counted, the last one's fields kept. The window closes when the
    next line of the key comes after ``interval`` (that line is printed with
    ``suppressed=N``), when it has expired at any later call (oldest first), or when more
    than ``cap`` windows are open (the oldest goes). A window closed without a next line of
    its key, and with lines dropped, hands back a summary: its last dropped line with
    ``suppressed`` = the others. Every line is thus printed or counted in a printed line.
    Not thread-safe by itself: :func:`limited` holds a lock around it.
    """

    def __init__(self, interval: float, cap: int = 256) -> None:
        self.interval = interval
        self.cap = cap
        self._windows: "OrderedDict[object, _Window]" = OrderedDict()  # oldest start first

    def __len__(self) -> int:
        return len(self._windows)

    def admit(self, key, now: float, level: str, event: str, fields: dict):
        """(fields to print now or None, summaries ``(level, event, fields)`` to print)."""
        window = self._windows.get(key)
        carried = 0
        if window is not None and now - window.start < self.interval:
            window.suppressed += 1
            window.level, window.event, window.latest = level, event, fields
            return None, self.sweep(now)
        if window is not None:  # expired: this line reports what it dropped
            carried = window.suppressed
            del self._windows[key]
        summaries = self.sweep(now)
        self._windows[key] = _Window(now)
        while len(self._windows) > self.cap:
            summaries.extend(self._summary(self._windows.popitem(last=False)[1]))
        if carried:
            fields = dict(fields, suppressed=carried)
        return fields, summaries

    def sweep(self, now: float) -> list:
        """Close the expired windows, oldest first; the summaries the caller must print."""
        summaries = []
        while self._windows:
            oldest = next(iter(self._windows.values()))
            if now - oldest.start < self.interval:
                break
            self._windows.popitem(last=False)
            summaries.extend(self._summary(oldest))
        return summaries

    @staticmethod
    def _summary(window: _Window) -> list:
        if not window.suppressed:
            return []
        fields = dict(window.latest)
        if window.suppressed > 1:
            fields["suppressed"] = window.suppressed - 1
        return [(window.level, window.event, fields)]

    def clear(self) -> None:
        self._windows.clear()


class BoundedSet:
    """Keys seen, oldest forgotten beyond ``cap`` (a forgotten key may log once more)."""

    def __init__(self, cap: int = 1024) -> None:
        self.cap = cap
        self._keys: "OrderedDict[object, None]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key) -> bool:
        """True if ``key`` was not there."""
        if key in self._keys:
            return False
        self._keys[key] = None
        while len(self._keys) > self.cap:
            self._keys.popitem(last=False)
        return True

    def clear(self) -> None:
        self._keys.clear()


_limiter = RateLimiter(RATE_LIMIT_S)
_once_seen = BoundedSet()


def rate_limiter() -> RateLimiter:
    return _limiter


def reset_rate_limits() -> None:
    """Forget every window and once-key (tests)."""
    with _limit_lock:
        _limiter.clear()
        _once_seen.clear()


def limited(key, level: str, event: str, **fields) -> None:
    """:func:`emit`, at most once per :data:`RATE_LIMIT_S` per key; counts what it dropped.

    ``key`` names a kind of problem (fix, kind): never a request id, which goes in ``fields``.
    """
    with _limit_lock:
        fields, summaries = _limiter.admit(key, time.monotonic(), level, event, fields)
    for summary_level, summary_event, summary_fields in summaries:
        emit(summary_level, summary_event, **summary_fields)
    if fields is not None:
        emit(level, event, **fields)


def once(key, level: str, event: str, **fields) -> bool:
    """:func:`emit` the first time ``key`` is seen in this process; True if it did."""
    with _limit_lock:
        if not _once_seen.add(key):
            return False
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
