"""H3: every per-process map of the hotfix stays bounded, whatever request ids go through it.

The abnormal reports go through xfer-guard's real wrapper on the real
``Scheduler._update_from_kv_xfer_finished`` (a scheduler that knows none of the ids: every
one is case 3, ``recv_unknown``), so the keys are whatever xfer-guard really rate-limits by.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Sized

import pytest

from hotfix import log
from hotfix.worlds.hotfix_on import hotfix_active

REPORTS = 100_000
#: what any single per-process map may hold after REPORTS distinct requests (log.RateLimiter
#: and log's once-set have caps of this order; the hold ledger and load barrier are per
#: instance, capped and tested in their own files)
CAP = 1024
MODULES = ("hotfix.log", "hotfix.status", "hotfix.config", "hotfix.runtime", "hotfix.registry",
           "hotfix.fixes._holds", "hotfix.fixes.xfer_guard", "hotfix.fixes.recv_barrier",
           "hotfix.fixes.pull_pin", "hotfix.fixes.load_bound")


def per_process_entries() -> dict:
    """``module.name -> len`` of every module-level container of the hotfix (constants such
    as strings and tuples excluded): whatever a long-lived process accumulates."""
    sizes = {}
    for name in MODULES:
        module = sys.modules.get(name)
        for attr, value in vars(module or object()).items():
            if attr.startswith("__") or isinstance(value, (str, bytes, tuple, frozenset, type)) \
                    or not isinstance(value, Sized):
                continue
            sizes[f"{name}.{attr}"] = len(value)
    return sizes


@pytest.fixture
def clock(monkeypatch):
    """A frozen clock past every rate-limit window opened so far in this process (whose
    summaries earlier tests' lines would otherwise print first: forget them)."""
    log.reset_rate_limits()
    now = [log.time.monotonic() + 10 * log.RATE_LIMIT_S]
    monkeypatch.setattr(log.time, "monotonic", lambda: now[0])
    return now


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())

    def of(self, event: str) -> list:
        return [m for m in self.messages if f"event='{event}'" in m]


@pytest.fixture
def lines():
    """What reaches the ``vllm.hotfix`` logger (vLLM's ``vllm`` logger does not propagate
    to the root, where caplog listens). Attached after vLLM configured logging, which
    empties the handlers of existing ``vllm.*`` loggers."""
    import vllm  # noqa: F401

    logger = logging.getLogger(log.LOGGER_NAME)
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_100k_distinct_request_reports_keep_every_per_process_map_under_its_cap(clock, lines):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput

    scheduler = object.__new__(Scheduler)  # knows no request: every report is recv_unknown
    scheduler.connector = None
    scheduler.requests = {}
    scheduler.finished_recving_kv_req_ids = set()
    with hotfix_active("xfer-guard"):
        for batch in range(REPORTS // 1000):
            ids = {f"req-{batch}-{i}" for i in range(1000)}
            scheduler._update_from_kv_xfer_finished(KVConnectorOutput(finished_recving=ids))
        sizes = per_process_entries()
        assert max(sizes.values()) <= CAP, {k: v for k, v in sizes.items() if v > CAP}
        assert len(lines.of('hotfix.xfer.unexpected')) == 1  # one line per kind and window, not per request

        clock[0] += log.RATE_LIMIT_S + 1  # the window ends; the next report of that kind ...
        scheduler._update_from_kv_xfer_finished(KVConnectorOutput(finished_recving={"req-last"}))
    first, latest = lines.of('hotfix.xfer.unexpected')
    assert "suppressed=" not in first
    # ... carries what the window dropped and the latest request id
    assert f"suppressed={REPORTS - 1}" in latest and "req_id='req-last'" in latest


def test_request_keyed_callers_are_bounded_and_no_suppressed_count_is_lost(clock, lines):
    """A caller that still keys by request: the rate limiter keeps at most its cap of windows;
    a window closed by the cap or by time prints its last dropped line with the count."""
    log.reset_rate_limits()
    cap = log.rate_limiter().cap
    keys, repeats = 2 * cap, 10
    for i in range(keys * repeats):  # each request reported 10 times in a row
        log.limited(("t", i // repeats), "error", "hotfix.test.keyed", req_id=f"r{i}")
        assert len(log.rate_limiter()) <= cap
    clock[0] += log.RATE_LIMIT_S + 1
    log.limited(("other",), "error", "hotfix.test.other")  # any call sweeps expired windows
    assert len(log.rate_limiter()) == 1  # only the window just opened
    keyed = lines.of("hotfix.test.keyed")
    assert len(keyed) == 2 * keys  # per window: its first line, then its last with the count
    for k in range(keys):
        last = f"req_id='r{k * repeats + repeats - 1}'"
        assert [m for m in keyed if last in m and f"suppressed={repeats - 2}" in m]


def test_once_keys_are_bounded(clock):
    try:
        for i in range(REPORTS // 10):
            log.once(("t", f"r{i}"), "debug", "hotfix.test.once")
        assert max(per_process_entries().values()) <= CAP
    finally:
        log.reset_rate_limits()


class _Instance:
    """A stand-in ``self`` for a wrapper: only what the wrapper reads."""


def test_a_degraded_recv_barrier_keeps_no_load_plans():
    """Once the scheduler side degraded, ``build_connector_meta`` ships nothing: the plans that
    ``update_state_after_alloc`` would record are no longer taken, and any taken before are
    dropped, instead of one entry (with its Request) per remote-prefill request forever."""
    from types import SimpleNamespace

    from hotfix.fixes import recv_barrier

    connector = _Instance()
    connector._requests_to_connector = {}
    connector.__dict__["_hotfix_unshipped_plans"] = {"before": (0, None)}
    connector.__dict__["_hotfix_degraded"] = True
    for i in range(REPORTS // 10):
        connector._requests_to_connector[f"r{i}"] = 0
        recv_barrier.plan_async_loads(lambda *a, **k: None, connector,
                                      (SimpleNamespace(request_id=f"r{i}"), None, 48), {})
        connector._requests_to_connector.pop(f"r{i}")
        recv_barrier.ship_load_plans(lambda *a, **k: SimpleNamespace(), connector, (), {})
    assert len(connector.__dict__.get("_hotfix_unshipped_plans", ())) == 0


def test_save_hold_evictions_are_reported_not_accumulated():
    """Holds beyond the ledger's cap evict the oldest; the evicted ids are reported (and
    counted) when a save hold evicts them too, not only when a recv hold does."""
    from types import SimpleNamespace

    from hotfix import status
    from hotfix.fixes import xfer_guard
    from hotfix.fixes._holds import HoldLedger

    scheduler = _Instance()
    ledger = scheduler.__dict__["_hotfix_holds"] = HoldLedger(cap=8)
    before = status.counters().get("xfer-guard", {}).get("hold_evicted", 0)
    for i in range(1000):
        xfer_guard.record_save_hold(lambda *a, **k: (True, None), scheduler,
                                    (SimpleNamespace(request_id=f"r{i}"),), {})
    assert len(ledger) == 8 and ledger.evicted == []
    assert status.counters()["xfer-guard"]["hold_evicted"] - before == 992


def test_counters_of_unexpected_kinds_fold_into_one_key(monkeypatch):
    from collections import Counter

    from hotfix import status

    monkeypatch.setattr(status, "_counters", Counter())  # the process's counters stay as they are
    for i in range(REPORTS // 10):
        status.count("test-fix", f"kind-{i}")
    assert len(status._counters) == status.MAX_KEYS
    assert status.counters()["hotfix"]["other_kinds"] == REPORTS // 10 - (status.MAX_KEYS - 1)
