"""Per-process runtime status: what was applied, and counters of what the fixes saw.

Counters are plain in-process integers (cheap on the hot path); the JSON file
``$HOTFIX_STATUS_DIR/<pid>.json`` is rewritten when a decision changes, when a kind of event
is seen for the first time, and at most every :data:`FLUSH_INTERVAL_S` when only counts
moved — a count that falls inside the interval is written by a one-shot timer at its end
(never by the hot path), so the file is never more than an interval behind, idle or not.
An operator can read what every EngineCore and worker did without attaching to it.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter

FLUSH_INTERVAL_S = 10.0
#: counters are keyed by (fix, kind), a fixed vocabulary; beyond this many keys a new one is
#: counted as ("hotfix", "other_kinds"), so the map stays bounded whatever a caller passes
MAX_KEYS = 256

_counters: Counter = Counter()
_degraded: dict = {}  # fix -> reason; one entry per fix at most
_lock = threading.Lock()
_last_flush = 0.0
_flush_scheduled = False  # a timer will write the counts that came inside the interval


def count(fix: str, kind: str, n: int = 1) -> None:
    """Count one event of ``kind`` for ``fix`` (e.g. ``xfer-guard``, ``unexpected_recv``)."""
    global _flush_scheduled
    with _lock:
        first = (fix, kind) not in _counters  # a new kind of event is written at once
        if first and len(_counters) >= MAX_KEYS - 1:  # the last key is the overflow's
            fix, kind = "hotfix", "other_kinds"
        _counters[(fix, kind)] += n
        since = time.monotonic() - _last_flush
        due = first or since >= FLUSH_INTERVAL_S
        later = not due and not _flush_scheduled
        if later:
            _flush_scheduled = True
    if due:
        _flush()
    elif later:
        timer = threading.Timer(FLUSH_INTERVAL_S - since, _scheduled_flush)
        timer.daemon = True
        timer.start()


def _flush() -> None:
    from hotfix import registry

    act = registry.activation()
    if act is not None:
        write(act)


def _scheduled_flush() -> None:
    global _flush_scheduled
    with _lock:
        _flush_scheduled = False
    try:
        _flush()
    except Exception:  # noqa: BLE001 - a status file is best effort; the next count retries
        pass


def _forget_timer_in_child() -> None:
    """A forked child has no timer thread (only the parent's flag)."""
    global _flush_scheduled
    _flush_scheduled = False


def degrade(fix: str, reason: str) -> None:
    """``fix`` runs as stock in this process (a half is missing); shown in the status file."""
    with _lock:
        first = fix not in _degraded
        _degraded.setdefault(fix, reason)
    if first:
        from hotfix import registry

        act = registry.activation()
        if act is not None:
            write(act)


def undegrade(fix: str) -> None:
    """The fix was reverted in this process: it is no longer running degraded."""
    with _lock:
        _degraded.pop(fix, None)


def degraded() -> dict:
    with _lock:
        return dict(_degraded)


def counters() -> dict:
    """``{fix: {kind: n}}`` of this process."""
    with _lock:
        out: dict = {}
        for (fix, kind), n in _counters.items():
            out.setdefault(fix, {})[kind] = n
        return out


def snapshot(act) -> dict:
    from hotfix import __version__, log, registry

    fixes = act.snapshot()
    for fix, reason in degraded().items():
        if fix in fixes and fixes[fix]["state"] in ("applied", "pending"):
            fixes[fix] = {**fixes[fix], "state": "degraded", "reason": reason}
    return {
        "pid": os.getpid(),
        "role": log.role(),
        "activated_by": act.source,
        "hotfix_version": __version__,
        "vllm_version": registry.vllm_version(),
        "fixes": fixes,
        "counters": counters(),
        "written_at": time.time(),
    }


def write(act) -> None:
    """Write this process's status file; best effort (a read-only /tmp must not matter)."""
    global _last_flush
    from hotfix import config

    directory = config.status_dir()
    try:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{os.getpid()}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(snapshot(act), fh, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass
    with _lock:
        _last_flush = time.monotonic()


def read_all(directory: str) -> list:
    """Every status file in ``directory`` (for ``python -m hotfix status --runtime``)."""
    out = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if name.endswith(".json"):
            try:
                with open(os.path.join(directory, name), encoding="utf-8") as fh:
                    out.append(json.load(fh))
            except (OSError, ValueError):
                continue
    return out


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_timer_in_child)
