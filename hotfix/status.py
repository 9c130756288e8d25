"""Per-process runtime status: what was applied, who this process is, what the fixes saw.

Counters and gauges are plain in-process values (cheap on the hot path, no I/O there). The
JSON file ``<status dir>/<pid>.json`` is written atomically (temp file + ``os.replace``) when
a decision changes, and by a one-shot timer at most every :data:`FLUSH_INTERVAL_S` when only
counts or gauges moved: never by the caller of :func:`count`, and never more than one
interval behind, idle or not. At exit a process writes its last record with ``exited_at``
(kept for post-mortems, at most :data:`KEEP_EXITED` per directory, oldest removed); a record
of a pid that is gone without one (SIGKILL) reads as dead. Readers of the live state
(``hotfix.metrics``) use neither.

The directory is one per vLLM instance unless ``HOTFIX_STATUS_DIR`` names one: the first
process of a tree that activates (the API server, or an ``LLM`` driver) names the instance
after itself in ``HOTFIX_INSTANCE``, and its multiprocessing children (EngineCore, workers,
further API servers) inherit it, so two engines on one host never mix.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter

from hotfix import fingerprint, forksafe

FLUSH_INTERVAL_S = 1.0
#: counters are keyed by (fix, kind), a fixed vocabulary; beyond this many keys a new one is
#: counted as ("hotfix", "other_kinds"), so the map stays bounded whatever a caller passes
MAX_KEYS = 256
#: records of exited processes kept per directory (post-mortem), oldest removed beyond it
KEEP_EXITED = 32
#: instance directories of dead instances kept beside the live ones, oldest removed beyond it
KEEP_DEAD_INSTANCES = 8
INSTANCE_VAR = "HOTFIX_INSTANCE"

_counters: Counter = Counter()
_gauges: dict = {}  # (fix, name) -> int; bounded like the counters
_degraded: dict = {}  # fix -> reason; one entry per fix at most
_identity: dict = {}  # model_name, engine, rank, ... as vLLM's constructors told us
_lock = threading.Lock()
forksafe.renew_in_child(sys.modules[__name__], "_lock")
_replace_lock = threading.Lock()  # taken alone, around the file's replacement only
forksafe.renew_in_child(sys.modules[__name__], "_replace_lock")
_snapshots = 0  # numbers each record as it is taken; an older one never replaces a newer
_written = 0
_last_flush = 0.0
_flush_scheduled = False  # a timer will write what changed since the last write
_exited_at = None
_instance = None


def count(fix: str, kind: str, n: int = 1) -> None:
    """Count ``n`` events of ``kind`` for ``fix`` (e.g. ``xfer-guard``, ``recv_unknown``)."""
    with _lock:
        if (fix, kind) not in _counters and len(_counters) >= MAX_KEYS - 1:
            fix, kind = "hotfix", "other_kinds"  # the last key is the overflow's
        _counters[(fix, kind)] += n
        _schedule_locked()


def gauge(fix: str, name: str, value: int) -> None:
    """Set a level (blocks pinned now, requests held now); written like a count."""
    with _lock:
        key = (fix, name)
        if _gauges.get(key) == value or (key not in _gauges and len(_gauges) >= MAX_KEYS):
            return
        _gauges[key] = value
        _schedule_locked()


def identify(**fields) -> None:
    """What vLLM told this process about itself (kind, model, engine index, rank)."""
    with _lock:
        _identity.update({k: v for k, v in fields.items() if v is not None})
        _schedule_locked()


def _schedule_locked() -> None:
    global _flush_scheduled
    if _flush_scheduled:
        return
    _flush_scheduled = True
    delay = min(FLUSH_INTERVAL_S, max(0.0, FLUSH_INTERVAL_S - (time.monotonic() - _last_flush)))
    timer = threading.Timer(delay, _scheduled_flush)
    timer.daemon = True
    timer.start()


def _scheduled_flush() -> None:
    global _flush_scheduled, _last_flush
    with _lock:
        _flush_scheduled = False  # changes from now on are the next write's
        _last_flush = time.monotonic()
    try:
        _flush()
    except Exception:  # noqa: BLE001 - a status file is best effort; the next change retries
        pass


def _activation_of_this_process():
    return None  # until the registry hands its getter in (write_records_of)


def write_records_of(activation) -> None:
    """``activation()`` gives this process's activation (the registry's): the records' source,
    handed in so that the status layer never imports the registry above it."""
    global _activation_of_this_process
    _activation_of_this_process = activation


def _flush() -> None:
    act = _activation_of_this_process()
    if act is not None:
        write(act)


def _start_afresh_in_child() -> None:
    """A forked child has no timer thread (only the parent's flag), and what the parent
    counted, degraded or was told about itself is the parent's, not the child's."""
    global _flush_scheduled
    _flush_scheduled = False
    _counters.clear()
    _gauges.clear()
    _degraded.clear()
    _identity.clear()


def degrade(fix: str, reason: str) -> None:
    """``fix`` runs as stock in this process (a half is missing); shown in the status file."""
    with _lock:
        first = fix not in _degraded
        _degraded.setdefault(fix, reason)
    if first:
        _flush()


def undegrade(fix: str) -> None:
    """The fix was reverted in this process: it is no longer running degraded."""
    with _lock:
        _degraded.pop(fix, None)


def degraded() -> dict:
    with _lock:
        return dict(_degraded)


def counters() -> dict:
    """``{fix: {kind: n}}`` of this process."""
    return _by_fix(_counters)


def gauges() -> dict:
    """``{fix: {name: value}}`` of this process."""
    return _by_fix(_gauges)


def _by_fix(flat) -> dict:
    with _lock:
        out: dict = {}
        for (fix, key), value in flat.items():
            out.setdefault(fix, {})[key] = value
        return out


def instance() -> str:
    """This process's vLLM instance: inherited by multiprocessing children, else its own."""
    global _instance
    if _instance is None:
        import multiprocessing

        inherited = os.environ.get(INSTANCE_VAR, "")
        if inherited and multiprocessing.parent_process() is not None:
            _instance = inherited
        else:
            _instance = f"{os.getpid()}-{int(time.time())}"
            os.environ[INSTANCE_VAR] = _instance  # for the children this process starts
            _prune_dead_instances()
    return _instance


_versions: dict = {}  # the installed vLLM's version, read once (importlib.metadata is slow)


def _vllm_version():
    if "vllm" not in _versions:
        _versions["vllm"] = fingerprint.vllm_version()
    return _versions["vllm"]


def snapshot(act) -> dict:
    from hotfix import log
    from hotfix._version import __version__

    fixes = act.snapshot()
    for fix, reason in degraded().items():
        if fix in fixes and fixes[fix]["state"] in ("applied", "pending"):
            fixes[fix] = {**fixes[fix], "state": "degraded", "reason": reason}
    with _lock:
        identity = dict(_identity)
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "role": log.role(),
        "instance": instance(),
        "model_name": identity.pop("model_name", None),
        "engine": identity.pop("engine", None),
        "rank": identity.pop("rank", None),
        "identity": identity,
        "activated_by": act.source,
        "hotfix_version": __version__,
        "vllm_version": _vllm_version(),
        "fixes": fixes,
        "counters": counters(),
        "gauges": gauges(),
        "written_at": time.time(),
        "exited_at": _exited_at,
    }


def write(act) -> None:
    """Write this process's status file; best effort (a read-only /tmp must not matter)."""
    global _last_flush
    global _snapshots, _written
    directory = directory_of_this_instance()
    with _lock:
        _snapshots += 1
        mine = _snapshots
    try:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{os.getpid()}.json")
        tmp = f"{path}.{threading.get_ident()}.tmp"  # the timer and a hook may write at once
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(snapshot(act), fh, sort_keys=True)
        with _replace_lock:  # the timer's record, taken before a degrade, must not land after it
            if mine > _written:
                os.replace(tmp, path)
                _written = mine
            else:
                os.remove(tmp)
    except OSError:
        pass
    with _lock:
        _last_flush = time.monotonic()


def read_all(directory: str) -> list:
    """Every status record in ``directory`` (corrupt or half-written files are skipped)."""
    out = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if name.endswith(".json"):
            try:
                with open(os.path.join(directory, name), encoding="utf-8") as fh:
                    record = json.load(fh)
            except (OSError, ValueError):
                continue
            if isinstance(record, dict) and isinstance(record.get("pid"), int):
                out.append(record)
    return out


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs. A zombie does not: it has exited and only waits for a parent to
    reap it, which a container's init may never do."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # exists, not ours to signal (PermissionError)
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return True  # no /proc to ask: it exists


def is_live(record: dict) -> bool:
    """A record of a running process (not exited, pid still there)."""
    return not record.get("exited_at") and pid_alive(record["pid"])


# --------------------------------------------------------------------------------------
# Exit and pruning
# --------------------------------------------------------------------------------------

def _on_exit() -> None:
    """Last record, marked exited; then keep the directory's exited records bounded."""
    global _exited_at
    if _exited_at is not None:
        return
    _exited_at = time.time()
    try:
        act = _activation_of_this_process()
        if act is None:
            return
        write(act)
        _prune_exited()
    except Exception:  # noqa: BLE001 - never fail an exiting process
        pass


def _prune_exited() -> None:
    directory = directory_of_this_instance()
    exited = [r for r in read_all(directory) if r.get("exited_at") or not pid_alive(r["pid"])]
    exited.sort(key=lambda r: r.get("exited_at") or r.get("written_at") or 0)
    for record in exited[:max(0, len(exited) - KEEP_EXITED)]:
        try:
            os.unlink(os.path.join(directory, f"{record['pid']}.json"))
        except OSError:
            pass


def directory_of_this_instance() -> str:
    """``HOTFIX_STATUS_DIR``, else this process's vLLM instance's directory under the temp dir."""
    explicit = os.environ.get("HOTFIX_STATUS_DIR")
    if explicit:
        return explicit
    return os.path.join(instance_root(), instance())


def instance_root() -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), "vllm-hotfix")


def _prune_dead_instances() -> None:
    """A new instance removes all but the newest few instance directories with nothing live."""
    if os.environ.get("HOTFIX_STATUS_DIR"):
        return
    root = instance_root()
    try:
        entries = [os.path.join(root, n) for n in os.listdir(root)]
    except OSError:
        return
    dead = [d for d in entries if os.path.isdir(d) and not any(is_live(r) for r in read_all(d))]
    dead.sort(key=lambda d: os.path.getmtime(d))
    import shutil

    for directory in dead[:max(0, len(dead) - KEEP_DEAD_INSTANCES)]:
        shutil.rmtree(directory, ignore_errors=True)


_exit_token = type("_ExitToken", (), {})()  # kept alive: multiprocessing's after-fork registry is weak


def _register_exit_in_forked_child() -> None:
    """A forked multiprocessing child ends with ``os._exit`` (no atexit): use its finalizers,
    which its bootstrap clears first and then re-arms through ``register_after_fork`` (the
    registration is inherited by every forked descendant)."""
    try:
        from multiprocessing import util

        util.register_after_fork(_exit_token, lambda _token: util.Finalize(_exit_token, _on_exit, exitpriority=100))
    except Exception:  # noqa: BLE001
        pass


def _install_exit_hooks() -> None:
    import atexit

    atexit.register(_on_exit)
    _register_exit_in_forked_child()
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_start_afresh_in_child)


_install_exit_hooks()
