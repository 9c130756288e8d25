"""lease-guard (D6): a decode node never READs prefill KV whose lease may have run out.

A prefill node (P) keeps a finished request's blocks for ``kv_lease_duration`` (30 s by
default) and frees them when the lease runs out; the decode node (D) renews the lease by
heartbeats, but only from the moment its scheduler has the request. A request that reaches
D later (a router retrying on another decode after one died, a queue, a restarting decode)
is READ from blocks P has already given to other requests: D decodes garbage and reports
nothing (P logs "Potentially invalid KV blocks for unrecognized request" afterwards).

The fix, in three places:
- P's NIXL scheduler (``request_finished`` of a prefill request) adds the lease's deadline,
  in wall-clock seconds, to the ``kv_transfer_params`` it returns (:data:`DEADLINE_KEY`);
  a router passes them to D unchanged.
- D's NIXL scheduler notes the deadline when the request arrives and judges the lease at the
  first moment D relies on it: the first heartbeat it sends for the request (from then on D
  renews the lease) or the READ, whichever comes first. A lease with less than
  ``HOTFIX_LEASE_GUARD_MARGIN_S`` (default 5 s, vLLM's own turn-2 slack: clock skew
  between the hosts, heartbeat and notification latency) left is refused: the READ goes to
  the worker marked (:data:`REFUSED_ATTR` on its ``ReqMeta``, a float).
- D's NIXL worker declines a marked READ before any byte moves, the way vLLM declines an
  expired turn-2 readback (``_handle_failed_transfer``): a failed remote load, so
  ``kv_load_failure_policy`` decides — ``recompute`` prefills locally, ``fail`` ends the
  request with an error. Never garbage.

A request without a deadline (a prefill without the hotfix, a router that drops the key)
keeps stock behaviour, counted, with one WARNING; a garbled deadline the same with one
ERROR. The EngineCore and worker halves agree first (``hotfix.halves``): the EngineCore
marks READs only while its workers have not been found missing, and a worker declines only
READs its EngineCore marked; the first connector output the EngineCore hears decides.

State: :class:`LeaseBook`, per D scheduler, the arrived requests whose lease is not judged
yet and the refused ones whose READ is not sent yet (bounded; entries leave when judged
trusted, when the READ is sent, or when the request finishes).
"""
from __future__ import annotations

import inspect
import math
import sys
import time
from collections import OrderedDict
from typing import Optional

from hotfix import config, halves, log, status
from hotfix.fixes._nixl_answer import answer_with
from hotfix.halves import SchedulerHalf, WorkerHalf
from hotfix.registry import LEAVE, FixSpec, Metric, Shape, Target
from hotfix.runtime import argument, contain, state_of

_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

SPEC = FixSpec(
    id="lease-guard",
    toggle="HOTFIX_LEASE_GUARD",
    title="a NIXL decode node declines the READ of a prefill lease that may have expired",
    defects=("D6",),
    targets=(
        # P: the lease starts here (`_reqs_need_send`); its params go to the router. D: forget.
        Target(f"{_NIXL}.pull_scheduler", "NixlPullConnectorScheduler.request_finished",
               "export_the_lease_deadline", "engine_core",
               {"91fd8be2f7611c4a": Shape("0.27.0-0.27.1"), "04a917e57992e7bf": Shape("0.28.0"),
                "b6276b0b12a78531": Shape("0.29.0"), "42776206c6366fa0": Shape("0.30.0-0.32.0"),
                "3fe7a73a45d06e72": Shape("0.33.0-0.34.0")}),
        # D: a request's arrival (where vLLM starts tracking it for heartbeats).
        Target(f"{_NIXL}.base_scheduler", "NixlBaseConnectorScheduler.on_new_request",
               "note_the_lease_at_arrival", "engine_core",
               {"f21aeb9e1358331b": Shape("0.27.0-0.28.0"), "0cb3b0972c478388": Shape("0.29.0-0.30.0"),
                "d7dca463a5e729ac": Shape("0.31.0-0.34.0")}),
        # D: the step's READs (`reqs_to_recv`) and heartbeats (`heartbeat_by_engine`) leave here.
        Target(f"{_NIXL}.base_scheduler", "NixlBaseConnectorScheduler.build_connector_meta",
               "refuse_reads_of_lapsed_leases", "engine_core",
               {"5e135d418e5f2cf1": Shape("0.27.0-0.28.0"), "8ca2f543bb825ebc": Shape("0.29.0"),
                "da785a694b3672f5": Shape("0.30.0-0.34.0")}),
        Target(f"{_NIXL}.connector", "NixlBaseConnector.update_connector_output",
               "hear_the_worker_halves", "engine_core", {"bf2025fe8d6fa496": Shape("0.27.0-0.34.0")}),
        # D worker: where a READ is issued, and where vLLM itself declines an expired one.
        Target(f"{_NIXL}.pull_worker", "NixlPullConnectorWorker._read_blocks_for_req",
               "decline_reads_of_lapsed_leases", "worker",
               {"f3126888cb9447d4": Shape("0.27.0-0.28.0"), "5ba709d64fda181b": Shape("0.29.0"),
                "07da318d4b244255": Shape("0.30.0"), "2142c404839749b5": Shape("0.31.0"),
                "399437a93211d5dd": Shape("0.32.0"), "986df93e32660ae0": Shape("0.33.0"),
                "06c3b9aa2998d45f": Shape("0.34.0")}),
        Target(f"{_NIXL}.base_worker", "NixlBaseConnectorWorker._handle_failed_transfer", "", "worker",
               {"50134fb19c89ff3c": Shape("0.27.0-0.29.0", LEAVE), "9560b4fb1f2c26d3": Shape("0.30.0", LEAVE),
                "73807639bc3b7812": Shape("0.31.0", LEAVE), "c2634ba0a6c48177": Shape("0.32.0-0.34.0", LEAVE)}),
        Target(f"{_NIXL}.metadata", "ReqMeta", "", "engine_core",
               {"7bacd61472082c9d": Shape("0.27.0-0.28.0", LEAVE), "28c86cec5600dc14": Shape("0.29.0", LEAVE),
                "b683315074485b9b": Shape("0.30.0-0.33.0", LEAVE),
                "c7379aa76d30ad2b": Shape("0.34.0", LEAVE)}),
        Target("vllm.distributed.kv_transfer.kv_connector.v1.base",
               "KVConnectorBase_V1.build_connector_worker_meta", "announce_the_worker_half", "worker",
               {"1396ed1bf292744b": Shape("0.27.0-0.34.0")}),
    ),
    upstream="none yet: NIXL's decode side READs whatever P's blocks hold once the lease "
    "lapsed; P only logs it afterwards (`Potentially invalid KV blocks for unrecognized request`)",
    remove_when="vLLM's NIXL connector carries the lease deadline to the decode node and "
    "declines a READ of an expired lease itself, in every release the fleet runs",
    metrics=(
        Metric("vllm:hotfix_lease_expired_reads_refused", "NIXL READs of prefill KV whose lease "
               "had (nearly) run out, refused before any byte moved (kv_load_failure_policy "
               "decides)", ("lease_expired_refused",),
               alert="rate > 0: decode admits requests later than the prefill's "
               "VLLM_NIXL_ABORT_REQUEST_TIMEOUT; stock vLLM would read reused blocks"),
        Metric("vllm:hotfix_lease_deadline_missing", "Remote prefills that arrived without the "
               "prefill's lease deadline (read as stock)", ("deadline_missing",),
               alert="rate > 0 with lease-guard on: a prefill runs without the hotfix, or the "
               "router drops kv_transfer_params keys"),
    ),
)

FIX = SPEC.id
DEADLINE_KEY = "hotfix_lease_deadline"  # kv_transfer_params: P's lease end, seconds since the epoch
REFUSED_ATTR = "hotfix_lease_refused"  # on a ReqMeta D ships: seconds past the deadline (float)
MARGIN_VAR = "HOTFIX_LEASE_GUARD_MARGIN_S"
DEFAULT_MARGIN_S = 5.0


class LeaseBook:
    """D's scheduler: what it knows of the leases of requests that will READ from a prefill.

    Lifecycle of an entry: :meth:`arrive` (deadline noted) → :meth:`judge` at the first
    heartbeat or READ: trusted (gone) or refused (kept) → :meth:`take_refusal` when the READ
    is shipped (gone) — or :meth:`forget` when the request finishes first. At most ``cap``
    entries; the oldest is dropped past that (its request gets stock behaviour, counted).
    """

    def __init__(self, margin_s: float, cap: int = 65536) -> None:
        self.margin_s = margin_s
        self.cap = cap
        self._deadlines: "OrderedDict[str, float]" = OrderedDict()  # arrived, not judged
        self._refused: "OrderedDict[str, float]" = OrderedDict()  # seconds past the deadline

    def __len__(self) -> int:
        return len(self._deadlines) + len(self._refused)

    def arrive(self, req_id: str, deadline: float) -> int:
        """Note R's deadline; returns how many entries the cap pushed out."""
        self.forget(req_id)
        self._deadlines[req_id] = deadline
        evicted = 0
        while len(self) > self.cap:
            (self._deadlines if self._deadlines else self._refused).popitem(last=False)
            evicted += 1
        return evicted

    def judge(self, req_id: str, now: float) -> Optional[float]:
        """R's lease is relied on now: seconds past its deadline if it is refused (within the
        margin counts as past), None if trusted or unknown. Judged once."""
        deadline = self._deadlines.pop(req_id, None)
        if deadline is None:
            return self._refused.get(req_id)
        if now + self.margin_s >= deadline:
            self._refused[req_id] = now - deadline
            return now - deadline
        return None

    def take_refusal(self, req_id: str, now: float) -> Optional[float]:
        """R's READ is being shipped: judge it if not yet, and hand out a refusal once."""
        self.judge(req_id, now)
        return self._refused.pop(req_id, None)

    def pending(self):
        """Requests arrived and not judged yet."""
        return list(self._deadlines)

    def forget(self, req_id: str) -> None:
        self._deadlines.pop(req_id, None)
        self._refused.pop(req_id, None)


def parse_deadline(raw) -> Optional[float]:
    """A deadline as P exported it, or None if it is not one (bool, text, NaN, <= 0)."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return None
    value = float(raw)
    return value if math.isfinite(value) and value > 0 else None


# ---------------------------------------------------------------------------------------
# Scheduler side (EngineCore): P exports, D judges
# ---------------------------------------------------------------------------------------

def _book(nixl_scheduler) -> LeaseBook:
    return state_of(nixl_scheduler, "_hotfix_leases",
                    lambda: LeaseBook(config.seconds(MARGIN_VAR, DEFAULT_MARGIN_S)))


def _scheduler_half(nixl_scheduler) -> SchedulerHalf:
    return state_of(nixl_scheduler, "_hotfix_lease_half", lambda: SchedulerHalf.for_engine(
        FIX, nixl_scheduler.vllm_config.parallel_config))


def export_the_lease_deadline(wrapped, instance, args, kwargs):
    """P: the params a finished prefill returns carry its lease's end (wall clock). D: a
    finished request leaves the book."""
    result = wrapped(*args, **kwargs)
    try:
        request = argument(args, kwargs, 0, "request")
        book = instance.__dict__.get("_hotfix_leases")
        if book is not None:
            book.forget(request.request_id)
        delay_free, params = result
        expires = instance._reqs_need_send.get(request.request_id) if delay_free else None
        if params and params.get("do_remote_prefill") and isinstance(expires, float):
            params[DEADLINE_KEY] = round(time.time() + (expires - time.perf_counter()), 3)
            _count("deadline_exported")
    except Exception as exc:
        contain(FIX, "NixlPullConnectorScheduler.request_finished", exc,
                fallback="no deadline exported for this request (the decode node reads as stock)")
    return result


def note_the_lease_at_arrival(wrapped, instance, args, kwargs):
    """D: a request that will READ from a prefill arrived; note its lease's deadline."""
    result = wrapped(*args, **kwargs)
    try:
        request = argument(args, kwargs, 0, "request")
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            _note(instance, request.request_id, params)
    except Exception as exc:
        contain(FIX, "NixlBaseConnectorScheduler.on_new_request", exc,
                fallback="this request's lease is not judged (stock READ)")
    return result


def _note(nixl_scheduler, req_id: str, params: dict) -> None:
    raw = params.get(DEADLINE_KEY)
    if raw is None:
        _count("deadline_missing")
        log.once((FIX, "deadline_missing"), "warning", "hotfix.lease.no_deadline", fix=FIX,
                 req_id=req_id, remote_engine_id=params.get("remote_engine_id"),
                 reason=f"kv_transfer_params carry no {DEADLINE_KEY}: the prefill node runs "
                 "without lease-guard, or the router drops the key",
                 action="stock READ for such requests (counted as deadline_missing)")
        return
    deadline = parse_deadline(raw)
    if deadline is None:
        _count("deadline_garbled")
        log.limited((FIX, "deadline_garbled"), "error", "hotfix.lease.bad_deadline", fix=FIX,
                    req_id=req_id, value=repr(raw)[:80],
                    reason=f"{DEADLINE_KEY} is not a positive number of seconds",
                    action="stock READ for this request")
        return
    if _book(nixl_scheduler).arrive(req_id, deadline):
        _count("book_evicted")


def refuse_reads_of_lapsed_leases(wrapped, instance, args, kwargs):
    """D: judge each lease when D first relies on it (a heartbeat or the READ leaving now);
    mark the READs of refused ones, and stamp the handshake."""
    metadata = wrapped(*args, **kwargs)
    if not _reads_by_pull(instance):
        return metadata  # push mode: no worker half could answer, so no handshake either
    try:
        half = _scheduler_half(instance)
        half.stamp(metadata)
        book = instance.__dict__.get("_hotfix_leases")
        if book is not None and len(book):
            now = time.time()
            if getattr(metadata, "heartbeat_by_engine", None):
                for req_id in book.pending():
                    if req_id in instance._heartbeat_req_engine:
                        book.judge(req_id, now)
            for req_id, req_meta in metadata.reqs_to_recv.items():
                late = book.take_refusal(req_id, now)
                if late is not None and half.may_act and _has_blocks(req_meta.local_block_ids):
                    setattr(req_meta, REFUSED_ATTR, round(late, 3))
                    _count("lease_expired_refused")
                    log.limited((FIX, "expired_refused"), "warning", "hotfix.lease.expired_refused",
                                fix=FIX, req_id=req_id,
                                remote_engine_id=req_meta.remote.engine_id if req_meta.remote else None,
                                seconds_past_deadline=round(late, 3), margin_s=book.margin_s,
                                action="the READ is declined before any byte moves: a failed "
                                "remote load (kv_load_failure_policy decides)")
    except Exception as exc:
        contain(FIX, "NixlBaseConnectorScheduler.build_connector_meta", exc,
                fallback="this step's READs are sent unjudged (stock)")
        halves.give_up(instance, "_hotfix_lease_half", f"build_connector_meta failed: {exc}")
    return metadata


def _reads_by_pull(nixl_scheduler) -> bool:
    """NIXL's pull scheduler: D READs from P (the only mode with a READ to judge; in push
    mode P writes into D and no pull worker exists to announce a worker half)."""
    pull = getattr(sys.modules.get(f"{_NIXL}.pull_scheduler"), "NixlPullConnectorScheduler", None)
    return pull is not None and isinstance(nixl_scheduler, pull)


def _has_blocks(block_ids) -> bool:
    ids = list(block_ids or ())
    return any(len(g) for g in ids) if ids and isinstance(ids[0], (list, tuple)) else bool(ids)


def hear_the_worker_halves(wrapped, instance, args, kwargs):
    """The first connector output decides whether every worker rank has the worker half."""
    try:
        scheduler = instance.connector_scheduler
        if scheduler is not None and _reads_by_pull(scheduler):
            meta = getattr(argument(args, kwargs, 0, "connector_output"), "kv_connector_worker_meta", None)
            _scheduler_half(scheduler).heard(meta)
    except Exception as exc:
        contain(FIX, "NixlBaseConnector.update_connector_output", exc,
                fallback="lease-guard degraded in this engine")
    return wrapped(*args, **kwargs)


# ---------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------

def decline_reads_of_lapsed_leases(wrapped, instance, args, kwargs):
    """A READ the EngineCore refused fails before any byte moves, as vLLM fails an expired
    turn-2 readback; everything else is NIXL's own READ."""
    try:
        req_id = argument(args, kwargs, 0, "req_id")
        late = getattr(argument(args, kwargs, 1, "meta"), REFUSED_ATTR, None)
        if late is not None:
            _fail_before_reading(instance, req_id)
    except Exception as exc:
        contain(FIX, _READ_TARGET, exc, fallback="this READ runs as stock")
        return wrapped(*args, **kwargs)
    if late is None:
        return wrapped(*args, **kwargs)
    try:  # declined: whatever happens now, the READ must not be issued after all
        _count("read_declined")
        log.info("hotfix.lease.read_declined", fix=FIX, req_id=req_id, seconds_past_deadline=late)
    except Exception as exc:
        contain(FIX, _READ_TARGET, exc, fallback="the declined READ is not counted")
    return None


_READ_TARGET = "NixlPullConnectorWorker._read_blocks_for_req"


def _fail_before_reading(worker, req_id: str) -> None:
    """vLLM's own decline of an expired read, in the installed release's form."""
    parameters = inspect.signature(worker._handle_failed_transfer).parameters
    call_args, call_kwargs = [req_id, None], {}
    if "failed_req_ids" in parameters:  # 0.30+: failures are collected per poll
        call_args.append(worker._recv_failures)
    if "record_failed_transfer" in parameters:  # 0.31+: expiry is not a transport failure
        call_kwargs["record_failed_transfer"] = False
    worker.xfer_stats.record_kv_expired_req()
    worker._handle_failed_transfer(*call_args, **call_kwargs)


def announce_the_worker_half(wrapped, instance, args, kwargs):
    """A NIXL worker whose EngineCore stamped lease-guard answers that its half is here."""
    meta = wrapped(*args, **kwargs)
    try:
        pull_worker = sys.modules.get(f"{_NIXL}.pull_worker")
        worker_cls = getattr(pull_worker, "NixlPullConnectorWorker", None)
        if worker_cls is None or not isinstance(getattr(instance, "connector_worker", None), worker_cls):
            return meta  # not NIXL's pull worker: nothing here declines a READ
        half = state_of(instance, "_hotfix_lease_half", lambda: WorkerHalf(FIX))
        bound = getattr(instance, "_connector_metadata", None)
        if bound is not None:
            half.bound(bound)
        if half.may_ship:
            return answer_with(meta, present=half.presence())
    except Exception as exc:
        contain(FIX, "KVConnectorBase_V1.build_connector_worker_meta", exc,
                fallback="no announcement this step")
    return meta


def _count(kind: str) -> None:
    status.count(FIX, kind)
