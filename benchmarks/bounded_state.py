"""H3: memory of the per-process log state after 1,000,000 abnormal reports, old vs new.

    python benchmarks/bounded_state.py

1,000,000 distinct requests each produce one abnormal report (``recv_unknown``: a
``finished_recving`` for an id the scheduler does not know) through xfer-guard's real wrapper
on the real ``Scheduler._update_from_kv_xfer_finished``, 1,000 ids a step. Emission is
stubbed out (we measure what the process keeps, not the handlers). tracemalloc measures what
stays allocated afterwards, and again once the rate-limit window has passed.

In the same run, the old behaviour: the ``limited()`` this package shipped before H3
(``log.py`` at 0fe9a20, copied below), fed the keys the old xfer-guard used,
``(fix, kind, req_id)``.
"""
from __future__ import annotations

import gc
import time
import tracemalloc

import _common  # noqa: F401  (sys.path, HF_HUB_OFFLINE)

REPORTS = 1_000_000
PER_STEP = 1000
RATE_LIMIT_S = 60.0


class OldLimited:
    """The replaced rate limiter, verbatim but for module globals -> attributes."""

    def __init__(self) -> None:
        self._last_emitted = {}
        self._suppressed = {}

    def limited(self, key, level, event, **fields):
        now = time.monotonic()
        last = self._last_emitted.get(key)
        if last is not None and now - last < RATE_LIMIT_S:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last_emitted[key] = now
        dropped = self._suppressed.pop(key, 0)
        if dropped:
            fields["suppressed"] = dropped


def retained(*phases) -> list:
    """Bytes still allocated after each of ``phases`` (callables, run in order, garbage
    collected after each), counted from before the first."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    out = []
    for phase in phases:
        phase()
        gc.collect()
        out.append(tracemalloc.get_traced_memory()[0] - base)
    tracemalloc.stop()
    return out


def main() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput

    from hotfix import log
    from hotfix.fixes import xfer_guard
    from hotfix.worlds.hotfix_on import hotfix_active

    log.emit = lambda *a, **k: None  # noqa: E731 (what the handlers do is not measured)

    old = OldLimited()

    def old_reports():
        for i in range(REPORTS):
            old.limited((xfer_guard.FIX, "recv_unknown", f"req-{i}"), "error",
                        "hotfix.xfer.unexpected", fix=xfer_guard.FIX, kind="recv_unknown",
                        req_id=f"req-{i}")

    scheduler = object.__new__(Scheduler)  # knows no request: every id is recv_unknown
    scheduler.connector = None
    scheduler.requests = {}
    scheduler.finished_recving_kv_req_ids = set()

    def new_reports():
        for step in range(REPORTS // PER_STEP):
            ids = {f"req-{step * PER_STEP + i}" for i in range(PER_STEP)}
            scheduler._update_from_kv_xfer_finished(KVConnectorOutput(finished_recving=ids))

    with hotfix_active("xfer-guard"):
        new_reports()  # warm-up: first-use allocations (ledger, counters, proxy class)
        log.reset_rate_limits()
        windows = []
        new_after, new_later = retained(
            new_reports,
            lambda: (windows.append(len(log.rate_limiter())),
                     log.rate_limiter().sweep(time.monotonic() + RATE_LIMIT_S + 1)))  # window passed
    (old_after,) = retained(old_reports)
    old_entries = len(old._last_emitted) + len(old._suppressed)

    print(f"per-process rate-limit state after {REPORTS:,} distinct-request abnormal reports")
    print(f"{'':26} {'entries':>9} {'retained B':>12}")
    print(f"{'old (req-keyed)':26} {old_entries:>9,} {old_after:>12,}")
    print(f"{'new (kind-keyed, capped)':26} {windows[0]:>9,} {new_after:>12,}")
    print(f"{'new, after the window':26} {len(log.rate_limiter()):>9,} {new_later:>12,}")
    print(f"ratio old/new: {old_after / max(new_after, 1):,.0f}x; "
          f"rate limiter cap: {log.rate_limiter().cap} windows")


if __name__ == "__main__":
    main()
