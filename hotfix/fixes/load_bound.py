"""load-bound (D8): no asynchronous KV load can keep a request waiting for ever.

vLLM has no bound on an asynchronous load on the decode side: a request stays in
``WAITING_FOR_REMOTE_KVS`` until every worker rank reported it. A READ that never ends (a
SIGSTOPped or partitioned prefill, one rank's READ, a hung LMCache server) wedges the request
for good, its blocks held and its client waiting; with recv-barrier the same happens when the
*non-chosen* loader hangs (stock computes over it instead).

The fix lives in the EngineCore alone (it needs no worker half):
- each step, an async load seen for the first time starts its clock (the step whose metadata
  the workers bind to start it: every rank starts it in that step);
- past ``HOTFIX_LOAD_TIMEOUT_S`` the request goes through vLLM's own failed-load path, so
  ``kv_load_failure_policy`` decides: the load is reported finished and failed in that step's
  output (``failed_recving`` on 0.30+; the request's load-target blocks as ``invalid_block_ids``
  on 0.27-0.29). ``fail`` ends it with an error; ``recompute`` retries it from a computed-token
  count of 0, so vLLM frees its blocks and the retry gets fresh ones (prefix-cache hits
  included), never the blocks the late transfer may still write. A request that passes the
  bound a second time, or a hybrid KV cache on 0.27-0.29 (whose invalid-block path cannot map
  blocks to requests), ends with an error the client sees;
- those load-target blocks are **quarantined**: one more reference each, so whatever vLLM frees
  they stay out of the pool until the late transfer really ends - the request's own report (all
  ranks, every loader under recv-barrier) or its failure report, which is absorbed (logged once)
  and gives the blocks back once. While blocks are quarantined the engine keeps stepping, so an
  idle engine hears that report within one step. No timer frees a quarantined block.
A load that ends within the bound is untouched: no extra step, no counter.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections import OrderedDict
from typing import List, Optional, Tuple

from hotfix import config, log, status
from hotfix.fixes._blocks import pool_of_group
from hotfix.runtime import argument, contain
from hotfix.fixes._scheduler_shapes import HAS_REQUESTS, UPDATE_FROM_OUTPUT
from hotfix.registry import LEAVE, FixSpec, Metric, Shape, Target

_SCHED = "vllm.v1.core.sched.scheduler"
TIMEOUT_VAR = "HOTFIX_LOAD_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0
CONNECTOR_KINDS = ("nixl", "lmcache", "other")  # label values of loads_timed_out

SPEC = FixSpec(
    id="load-bound",
    toggle="HOTFIX_LOAD_BOUND",
    title="an async KV load past HOTFIX_LOAD_TIMEOUT_S is a failed load; its blocks stay "
    "quarantined until the transfer ends",
    defects=("D8",),
    targets=(
        Target(_SCHED, "Scheduler.update_from_output", "fail_loads_past_the_bound", "engine_core",
               UPDATE_FROM_OUTPUT),
        Target(_SCHED, "Scheduler.has_requests", "keep_stepping_while_quarantined", "engine_core",
               HAS_REQUESTS),
        # what the failed-load path does with the report (read, not wrapped)
        Target(_SCHED, "Scheduler._update_waiting_for_remote_kv", "", "engine_core",
               {"d1d37947dfa81224": Shape("0.27.0-0.30.0", LEAVE), "d2d9b627bf867343": Shape("0.31.0", LEAVE),
                "a265f9c1a34e7ce4": Shape("0.32.0-0.34.0", LEAVE)}),
        Target(_SCHED, "Scheduler._handle_invalid_blocks", "", "engine_core",
               {"c59b2c44da058139": Shape("0.27.0-0.30.0", LEAVE),
                "e9c78cd2b60948ca": Shape("0.31.0-0.34.0", LEAVE)}),
        Target(_SCHED, "Scheduler._handle_failed_recving", "", "engine_core",
               {"5be57c8aabdbdbb9": Shape("0.30.0-0.34.0", LEAVE)}, may_be_absent=True),
    ),
    upstream="none yet: vLLM has no bound on a decode-side async KV load (to be filed with "
    "the scheduler-world reproduction)",
    remove_when="vLLM times out an asynchronous KV load into the failed-load path and keeps "
    "its blocks until the transfer ends, in every release the fleet runs",
    metrics=(
        Metric("vllm:hotfix_loads_timed_out", "Async KV loads that passed HOTFIX_LOAD_TIMEOUT_S "
               "and went to vLLM's failed-load path, by the connector the scheduler chose",
               tuple(f"timed_out_{c}" for c in CONNECTOR_KINDS), by_kind=True, label="connector",
               label_values=CONNECTOR_KINDS,
               alert="rate > 0: a transfer hangs (prefill stopped or cut off, LMCache server hung)"),
        Metric("vllm:hotfix_late_load_reports", "Reports of timed-out loads that ended after all "
               "(their quarantined blocks went back)", ("late_report",)),
        Metric("vllm:hotfix_blocks_quarantined_now", "KV blocks a timed-out load may still write, "
               "kept out of the pool until it ends", ("blocks_quarantined_now",), gauge=True,
               alert="stays > 0 at idle: a timed-out transfer never ended (blocks out of the pool)"),
    ),
)

FIX = SPEC.id
monotonic = time.monotonic  # the bound's clock (one per host: EngineCore and workers share it)


def timeout_s() -> Optional[float]:
    """``HOTFIX_LOAD_TIMEOUT_S``: seconds; ``0`` or ``off``: no bound (None)."""
    if os.environ.get(TIMEOUT_VAR, "").strip().lower() == "off":
        return None
    return config.seconds(TIMEOUT_VAR, DEFAULT_TIMEOUT_S) or None


class LoadClock:
    """Deadlines of the async loads in flight, oldest first (one bound, so start order is
    deadline order), each with the caller's label (the connector chosen at the start). An
    entry ends with its load; bounded by ``cap`` (oldest evicted, returned in ``evicted`` for
    the caller to log: that load is no longer bounded)."""

    def __init__(self, timeout: float, cap: int = 65536) -> None:
        self.timeout = timeout
        self.cap = cap
        self._deadlines: "OrderedDict[str, Tuple[float, str]]" = OrderedDict()
        self.evicted: List[str] = []

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._deadlines

    def start(self, req_id: str, now: float, label: str = "") -> None:
        self._deadlines[req_id] = (now + self.timeout, label)
        while len(self._deadlines) > self.cap:
            self.evicted.append(self._deadlines.popitem(last=False)[0])

    def end(self, req_id: str) -> None:
        self._deadlines.pop(req_id, None)

    def overdue(self, now: float) -> List[Tuple[str, str]]:
        """``(req_id, label)`` of the loads past their deadline, removed from the clock."""
        due = []
        while self._deadlines:
            req_id, (deadline, label) = next(iter(self._deadlines.items()))
            if deadline > now:
                break
            del self._deadlines[req_id]
            due.append((req_id, label))
        return due


class Quarantine:
    """Timed-out loads whose transfer may still write: their blocks per KV-cache group, by
    request id, until the late report. Every entry with blocks is bounded by the block pool;
    ``cap`` bounds the rest (an evicted entry's blocks are never freed: counted, logged).
    ``timed_out_before`` remembers recent timeouts, for the retry budget (one retry)."""

    def __init__(self, cap: int = 65536, remember: int = 8192) -> None:
        self.cap = cap
        self.remember = remember
        self._held: "OrderedDict[str, tuple]" = OrderedDict()
        self._timed_out: "OrderedDict[str, None]" = OrderedDict()
        self.evicted: List[str] = []

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._held

    @property
    def blocks(self) -> int:
        return sum(len(g) for groups in self._held.values() for g in groups)

    def timed_out_before(self, req_id: str) -> bool:
        return req_id in self._timed_out

    def add(self, req_id: str, groups: tuple) -> None:
        if req_id in self._held:  # a retry timed out while the first transfer still runs
            groups = tuple(a + b for a, b in zip(self._held.pop(req_id), groups))
        self._held[req_id] = groups
        self._timed_out[req_id] = None
        while len(self._timed_out) > self.remember:
            self._timed_out.popitem(last=False)
        while len(self._held) > self.cap:
            self.evicted.append(self._held.popitem(last=False)[0])

    def ended(self, req_id: str) -> tuple:
        """The late transfer ended: its blocks, to give back once."""
        return self._held.pop(req_id, ())


@dataclasses.dataclass
class _Step:
    """What one ``update_from_output`` call changed, for the part after vLLM's body."""

    retried: List[str] = dataclasses.field(default_factory=list)  # recompute: fresh blocks
    ended: List[tuple] = dataclasses.field(default_factory=list)  # quarantine to give back


class _State:
    __slots__ = ("clock", "quarantine")

    def __init__(self, timeout: float) -> None:
        self.clock = LoadClock(timeout)
        self.quarantine = Quarantine()


# ---------------------------------------------------------------------------------------
# Scheduler side (EngineCore)
# ---------------------------------------------------------------------------------------

def _state(scheduler) -> Optional[_State]:
    """This scheduler's bound, fixed at its first step (None: ``HOTFIX_LOAD_TIMEOUT_S`` off)."""
    if "_hotfix_load_bound" not in scheduler.__dict__:
        timeout = timeout_s()
        scheduler.__dict__["_hotfix_load_bound"] = _State(timeout) if timeout else None
    return scheduler.__dict__["_hotfix_load_bound"]


def fail_loads_past_the_bound(wrapped, instance, args, kwargs):
    """Before vLLM reads the step's output: absorb late reports of timed-out loads, start the
    clock of new loads, and report the loads past the bound as failed. After: give retried
    requests fresh blocks and quarantined blocks whose transfer ended back to the pool."""
    step = None
    try:
        state = _state(instance)
        if state is not None and instance.connector is not None:
            output = argument(args, kwargs, 1, "model_runner_output")
            step, changed = _before(instance, state, output)
            if changed is not output:
                args, kwargs = _replace_output(args, kwargs, changed)
    except Exception as exc:
        contain(FIX, "Scheduler.update_from_output", exc,
                fallback="this step's output as the workers sent it (loads unbounded this step)")
    result = wrapped(*args, **kwargs)
    if step is not None:
        try:
            _after(instance, state, step)
        except Exception as exc:
            contain(FIX, "Scheduler.update_from_output", exc,
                    fallback="quarantined blocks kept (out of the pool) until the next step")
    return result


def _replace_output(args, kwargs, output):
    if "model_runner_output" in kwargs:
        return args, {**kwargs, "model_runner_output": output}
    return args[:1] + (output,) + args[2:], kwargs


def _before(scheduler, state: _State, output) -> Tuple[_Step, object]:
    from vllm.v1.outputs import KVConnectorOutput

    step = _Step()
    kv = output.kv_connector_output
    recving = set(getattr(kv, "finished_recving", None) or ())
    failed = set(getattr(kv, "failed_recving", None) or ())
    late = _absorb_late_reports(state, step, recving | failed)
    for req_id in recving | failed:
        state.clock.end(req_id)
    now = monotonic()
    _start_the_clock_of_new_loads(scheduler, state, now, recving)
    failure = _Failure()
    for req_id, connector in state.clock.overdue(now):
        _fail_the_load_past_the_bound(scheduler, state, step, failure, req_id, connector, recving)
    if not (late or failure.recving):
        return step, output
    fields = {"finished_recving": (recving - late) | failure.recving}
    if _has_failed_recving():
        fields["failed_recving"] = (failed - late) | failure.failed
    if failure.invalid:
        fields["invalid_block_ids"] = set(getattr(kv, "invalid_block_ids", None) or ()) | failure.invalid
    kv = dataclasses.replace(kv, **fields) if kv is not None else KVConnectorOutput(**fields)
    return step, dataclasses.replace(output, kv_connector_output=kv)


@dataclasses.dataclass
class _Failure:
    """What this step's output gains for the loads past the bound."""

    recving: set = dataclasses.field(default_factory=set)  # reported finished (ends the wait)
    failed: set = dataclasses.field(default_factory=set)  # and failed (0.30+)
    invalid: set = dataclasses.field(default_factory=set)  # their load-target blocks (0.27-0.29)


def _absorb_late_reports(state: _State, step: _Step, reported: set) -> set:
    """Reports of loads that passed the bound: taken out of the output (vLLM already failed the
    request), their quarantined blocks go back after vLLM's body."""
    late = {r for r in reported if r in state.quarantine}
    for req_id in late:
        step.ended.append(state.quarantine.ended(req_id))
        _count("late_report")
        log.limited((FIX, "late_report"), "warning", "hotfix.load.late_report", fix=FIX,
                    req_id=req_id, reason="a load that passed the bound ended after all",
                    action="absorbed; its quarantined blocks go back to the pool")
    return late


def _start_the_clock_of_new_loads(scheduler, state: _State, now: float, reported: set) -> None:
    from vllm.v1.request import RequestStatus

    waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
    deferred = getattr(scheduler, "deferred_loads", None) or ()  # 0.33+: its load starts later
    for queue in _blocked_queues(scheduler):
        for request in queue:
            if request.status is waiting and request.request_id not in state.clock \
                    and request.request_id not in reported and request.request_id not in deferred:
                state.clock.start(request.request_id, now,
                                  _chosen_connector(scheduler.connector, request.request_id))
    _report_evictions(state)


def _fail_the_load_past_the_bound(scheduler, state: _State, step: _Step, failure: _Failure,
                                  req_id: str, connector: str, reported: set) -> None:
    from vllm.v1.request import RequestStatus

    request = scheduler.requests.get(req_id)
    if request is None or req_id in reported:
        return
    if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
        _held_by_vllm(scheduler, state, request, connector)
        return
    how = _failure_route(scheduler, state, req_id)
    groups = _quarantine_load_targets(scheduler, state, request)
    _count(f"timed_out_{connector}")
    log.limited((FIX, "timed_out", connector), "error", "hotfix.load.timed_out", fix=FIX,
                req_id=req_id, connector=connector, timeout_s=state.clock.timeout,
                blocks_quarantined=sum(len(g) for g in groups), action=how,
                reason=f"async KV load not finished within {TIMEOUT_VAR}={state.clock.timeout:g} s")
    failure.recving.add(req_id)
    if how == "error":
        _error_request(scheduler, req_id, state.clock.timeout)
    elif _has_failed_recving():
        failure.failed.add(req_id)
    else:
        failure.invalid.update(b.block_id for b in groups[0])
        if scheduler.recompute_kv_load_failures:
            step.retried.append(req_id)


def _blocked_queues(scheduler) -> tuple:
    """The queues a request waiting for remote KV sits in: ``skipped_waiting`` (0.27-0.30),
    ``kv_holding_waiting`` (0.31+). Both hold only blocked requests, so the scan stays short
    however long the waiting queue is."""
    return tuple(q for q in (getattr(scheduler, "kv_holding_waiting", None),
                             getattr(scheduler, "skipped_waiting", None)) if q)


def _held_by_vllm(scheduler, state: _State, request, connector: str) -> None:
    """Aborted while its load runs: vLLM itself keeps the blocks until the transfer reports
    (and frees them then); its client is gone. But on 0.34+ the load also holds one of the
    ``max_num_inflight_kv_loads`` slots (``_aborted_kv_loads``) until it reports, and every
    later async load waits for a slot: past the bound the slot is given back (the blocks stay
    vLLM's until the report), so a transfer that never ends cannot stall the loads after it."""
    aborted = getattr(scheduler, "_aborted_kv_loads", None)
    if aborted is not None:
        aborted.discard(request.request_id)
    _count(f"timed_out_{connector}")
    log.limited((FIX, "held_by_vllm", connector), "warning", "hotfix.load.timed_out", fix=FIX,
                req_id=request.request_id, connector=connector, timeout_s=state.clock.timeout,
                status=request.status.name, action="its in-flight load slot given back; vLLM "
                "holds its blocks until the transfer reports", reason=f"a finished request's async "
                f"KV load not done within {TIMEOUT_VAR}={state.clock.timeout:g} s")


def _failure_route(scheduler, state: _State, req_id: str) -> str:
    """How the timed-out load ends: vLLM's policy, or an error where that path cannot serve."""
    if state.quarantine.timed_out_before(req_id):
        return "error"  # its retry passed the bound too: bounded, not retried for ever
    if not _has_failed_recving() and len(scheduler.kv_cache_config.kv_cache_groups) > 1:
        return "error"  # 0.27-0.29 map invalid blocks of one group only
    return "recompute" if scheduler.recompute_kv_load_failures else "fail"


def _quarantine_load_targets(scheduler, state: _State, request) -> tuple:
    """One more reference on each block the load may write (R's blocks not yet cached: a
    load's targets are cached only once it ends), per KV-cache group."""
    per_group = scheduler.kv_cache_manager.get_blocks(request.request_id).blocks
    groups = tuple([b for b in blocks if not b.is_null and b.block_hash is None] for blocks in per_group)
    for block in (b for group in groups for b in group):
        block.ref_cnt += 1
    state.quarantine.add(request.request_id, groups)
    _quarantined_now(state)
    return groups


def _error_request(scheduler, req_id: str, timeout: float) -> None:
    """End the request with an error output, through the scheduler's own error channel."""
    errors = scheduler.grammar_compile_error_reqs
    if isinstance(errors, dict):  # 0.33+: the error's message reaches the client
        from vllm.outputs import RequestError

        errors[req_id] = RequestError(code="kv_load_timeout", retryable=True, message=(
            f"KV cache transfer did not finish within {TIMEOUT_VAR}={timeout:g} s"))
    else:
        errors.add(req_id)


def _after(scheduler, state: _State, step: _Step) -> None:
    from vllm.v1.request import RequestStatus

    for req_id in step.retried:  # 0.27-0.29: what 0.30's _handle_failed_recving does itself
        request = scheduler.requests.get(req_id)
        if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS \
                and req_id in scheduler.failed_recving_kv_req_ids:
            request.num_computed_tokens = 0
    if step.ended:
        manager = scheduler.kv_cache_manager
        for groups in step.ended:
            for group, blocks in enumerate(groups):
                if blocks:
                    pool_of_group(manager, group).free_blocks(blocks)
        _quarantined_now(state)


def keep_stepping_while_quarantined(wrapped, instance, args, kwargs):
    """An idle engine keeps stepping while blocks are quarantined, so the late report is
    heard (and the blocks go back) within one step of it; it stops once none are."""
    if wrapped(*args, **kwargs):
        return True
    try:
        state = instance.__dict__.get("_hotfix_load_bound")
        return bool(state is not None and len(state.quarantine))
    except Exception as exc:
        contain(FIX, "Scheduler.has_requests", exc, fallback="stock answer")
        return False


def _chosen_connector(connector, req_id: str) -> str:
    """The connector family the scheduler chose for R's load (the label of the counter)."""
    chosen = connector
    index = getattr(connector, "_requests_to_connector", {}).get(req_id)
    if index is not None:
        chosen = connector._connectors[index]
    name = type(chosen).__name__.lower()
    return next((c for c in CONNECTOR_KINDS[:-1] if c in name), "other")


_HAS_FAILED_RECVING: List[bool] = []


def _has_failed_recving() -> bool:
    """vLLM 0.30+: a failed async load is reported in ``failed_recving``."""
    if not _HAS_FAILED_RECVING:
        from vllm.v1.outputs import KVConnectorOutput

        _HAS_FAILED_RECVING.append(any(f.name == "failed_recving"
                                       for f in dataclasses.fields(KVConnectorOutput)))
    return _HAS_FAILED_RECVING[0]


def _report_evictions(state: _State) -> None:
    for book, what in ((state.clock, "no longer bounded"),
                       (state.quarantine, "its quarantined blocks stay out of the pool for good")):
        while book.evicted:
            req_id = book.evicted.pop()
            _count("evicted")
            log.emit("error", "hotfix.load.evicted", fix=FIX, req_id=req_id, cap=book.cap,
                     reason=f"too many entries in {type(book).__name__}", action=what)


def _quarantined_now(state: _State) -> None:
    status.gauge(FIX, "blocks_quarantined_now", state.quarantine.blocks)


def _count(kind: str) -> None:
    status.count(FIX, kind)

