"""lease-guard (D6): a decode node never READs prefill KV whose lease may have run out.

A prefill node (P) keeps a finished request's blocks for ``kv_lease_duration`` (30 s by
default) and frees them when the lease runs out; the decode node (D) renews the lease by
heartbeats, but only from the moment its scheduler has the request. A request that reaches
D later (a router retrying on another decode after one died, a queue, a restarting decode)
is READ from blocks P has already given to other requests: D decodes garbage and reports
nothing (P logs "Potentially invalid KV blocks for unrecognized request" afterwards).

The fix, in three places:
- P's NIXL scheduler (``request_finished`` of a prefill request) adds the lease's end to the
  ``kv_transfer_params`` it returns, on P's own monotonic clock (:data:`EXPIRY_KEY`: the clock
  P's NIXL handshake listener reports, so D can convert it with the offset vLLM measures in
  the handshake) and in wall-clock seconds (:data:`DEADLINE_KEY`, what earlier releases of the
  hotfix read); a router passes them to D unchanged.
- D's NIXL scheduler notes the lease when the request arrives and judges it at the first
  moment D relies on it: the first heartbeat that actually leaves for the request (from then on
  D renews the lease) or the READ, whichever comes first. NIXL's worker sends no heartbeat to a
  prefill it has no handshake with, so a heartbeat counts only once every worker rank reported
  that prefill's clock offset (:class:`PrefillClocks`, in the workers' answers); the lease is
  judged on P's clock (D's clock + that offset), never by comparing two hosts' wall clocks. A
  lease with less than ``HOTFIX_LEASE_GUARD_MARGIN_S`` (default 5 s, vLLM's own turn-2 slack:
  heartbeat and notification latency) left is refused: the READ goes to the worker marked
  (:data:`REFUSED_ATTR` on its ``ReqMeta``, a float). A READ that leaves before D knows P's
  clock (the first contact with that prefill) carries the lease instead (:data:`LEASE_ATTR`),
  and the worker judges it where the READ is posted, after the handshake, with its own offset.
- D's NIXL worker declines a refused READ before any byte moves, the way vLLM declines an
  expired turn-2 readback (``_handle_failed_transfer``): a failed remote load, so
  ``kv_load_failure_policy`` decides — ``recompute`` prefills locally, ``fail`` ends the
  request with an error. Never garbage.

- The confirmation (D6b, and a lease another decode renewed): a prefill that says so in the
  params (:data:`CONFIRM_KEY`) answers, on its NIXL handshake listener, whether it still holds
  a request's blocks (``hotfix.fixes._lease_confirm``). D then judges nothing by the deadline:
  the READ leaves marked (:data:`CONFIRM_ATTR`), the worker keeps NIXL's completion
  notification, asks P once the READ is done, and reports the load only on P's yes; on a no
  (the lease lapsed before or during the READ) the load fails through vLLM's failed-load
  path. A question P leaves unanswered for ``HOTFIX_LEASE_CONFIRM_TIMEOUT_S`` (default 5 s; 0
  turns the confirmation off on that node) while its side channel accepts connections is
  asked again as long as the next one ends within ``HOTFIX_LOAD_TIMEOUT_S`` (whose bound fails
  the request first): a stalled prefill's late yes is a right READ; past that, or when
  nothing listens there, the load fails too. A lease another decode's heartbeats renewed
  (a router's retry after a dead decode) is then READ, not refused. Cost: one side-channel
  round trip per READ before its report (and P frees the blocks that much later).
A lease with only a wall-clock deadline (a prefill of an earlier release) is judged by the wall
clocks, as before.

A request without a deadline (a prefill without the hotfix, a router that drops the key)
keeps stock behaviour, counted, with one WARNING; a garbled deadline the same with one
ERROR. The EngineCore and worker halves agree first (``hotfix.halves``): the EngineCore
marks READs only while its workers have not been found missing, and a worker declines only
READs its EngineCore marked; the first connector output the EngineCore hears decides.

State: :class:`LeaseBook`, per D scheduler, the arrived requests whose lease is not judged
yet and the refused ones whose READ is not sent yet (bounded; entries leave when judged
trusted, when the READ is sent, or when the request finishes); :class:`PrefillClocks`, per D
scheduler, each worker rank's offsets to the prefills it has a handshake with (bounded);
``HeldLeases`` per P EngineCore and ``PrefillConfirmations`` per D worker (bounded, see
``_lease_confirm``).
"""
from __future__ import annotations

import inspect
import math
import sys
import time
from collections import OrderedDict
from typing import Dict, Optional, Tuple

from hotfix import config, halves, log, status
from hotfix.fixes import _lease_confirm, load_bound
from hotfix.fixes._lease_confirm import HELD, Asker, HeldOrMetadata, PrefillConfirmations
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
        # P: the side-channel listener answers whether a request's blocks are still held.
        Target(f"{_NIXL}.base_scheduler", "NixlBaseConnectorScheduler._nixl_handshake_listener",
               "answer_whether_blocks_are_held", "engine_core", {"66a797aebb6d25c8": Shape("0.27.0-0.34.0")}),
        # D worker: a confirmed READ's completion, reported only once P said it held the blocks.
        Target(f"{_NIXL}.base_worker", "NixlBaseConnectorWorker._pop_done_transfers",
               "report_reads_once_the_prefill_confirmed", "worker",
               {"b9cb3121e5195644": Shape("0.27.0-0.29.0"), "ef47a1051a14bd33": Shape("0.30.0-0.34.0")}),
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
        Metric("vllm:hotfix_lease_reads_unconfirmed", "NIXL READs the prefill did not confirm "
               "(it had released the blocks before or during the READ: released; or no answer "
               "in HOTFIX_LOAD_TIMEOUT_S of asking, or nothing listening: unanswered), failed before their report "
               "(kv_load_failure_policy decides)", ("read_unconfirmed", "confirm_unanswered"),
               by_kind=True, label="reason", label_values=("released", "unanswered"),
               alert="rate > 0: a lease lapsed during a READ (the decode stalled past the "
               "heartbeat extension) or the prefill's side channel does not answer; stock vLLM "
               "would decode whatever the READ copied"),
        Metric("vllm:hotfix_lease_confirmations_asked_again", "Questions to a prefill's side "
               "channel asked again after HOTFIX_LEASE_CONFIRM_TIMEOUT_S without an answer (its "
               "READ waits; a late yes is a right READ)", ("confirm_asked_again",),
               alert="rate > 0: a prefill's EngineCore stalls for seconds (its answers, and its "
               "tokens, come late)"),
        Metric("vllm:hotfix_lease_deadline_missing", "Remote prefills that arrived without the "
               "prefill's lease deadline (read as stock)", ("deadline_missing",),
               alert="rate > 0 with lease-guard on: a prefill runs without the hotfix, or the "
               "router drops kv_transfer_params keys"),
    ),
)

FIX = SPEC.id
DEADLINE_KEY = "hotfix_lease_deadline"  # kv_transfer_params: P's lease end, seconds since the epoch
EXPIRY_KEY = "hotfix_lease_expiry"  # kv_transfer_params: P's lease end on P's EngineCore perf_counter
REFUSED_ATTR = "hotfix_lease_refused"  # on a ReqMeta D ships: seconds past the deadline (float)
LEASE_ATTR = "hotfix_lease"  # on a ReqMeta D ships unjudged: (wall deadline, end on P's clock)
CONFIRM_KEY = "hotfix_lease_confirm"  # kv_transfer_params: P's listener answers (wire version)
CONFIRM_ATTR = "hotfix_lease_confirm"  # on a ReqMeta D ships: confirm this READ with P (True)
MARGIN_VAR = "HOTFIX_LEASE_GUARD_MARGIN_S"
DEFAULT_MARGIN_S = 5.0
CONFIRM_TIMEOUT_VAR = "HOTFIX_LEASE_CONFIRM_TIMEOUT_S"
DEFAULT_CONFIRM_TIMEOUT_S = 5.0
CONFIRM_WIRE = 1


def confirm_timeout_s() -> float:
    """How long D's worker waits for P's answer; 0: this node neither offers nor asks."""
    return config.seconds(CONFIRM_TIMEOUT_VAR, DEFAULT_CONFIRM_TIMEOUT_S)


def seconds_late(deadline: Optional[float], expiry: Optional[float], now: float,
                 prefill_now: Optional[float]) -> Optional[float]:
    """Seconds past a lease's end (negative: time left), on P's clock when its end is known
    there; None when it cannot be told here (its end is on P's clock, and P's clock is not
    known). ``deadline``: the wall-clock end, judged with ``now`` (an earlier release's P)."""
    if expiry is not None:
        return None if prefill_now is None else prefill_now - expiry
    return None if deadline is None else now - deadline


class LeaseBook:
    """D's scheduler: what it knows of the leases of requests that will READ from a prefill.

    Lifecycle of an entry: :meth:`arrive` (lease noted) → :meth:`judge` at the first heartbeat
    that leaves or at the READ: trusted (gone), refused (kept), or not decidable here (kept) →
    :meth:`take_refusal` when the READ is shipped (gone), or :meth:`hand_over` of a lease the
    READ's worker must judge (gone) — or :meth:`forget` when the request finishes first. At
    most ``cap`` entries; the oldest is dropped past that (its request gets stock behaviour,
    counted).
    """

    def __init__(self, margin_s: float, cap: int = 65536) -> None:
        self.margin_s = margin_s
        self.cap = cap
        # arrived, not judged: (wall deadline, expiry on P's clock)
        self._leases: "OrderedDict[str, Tuple[Optional[float], Optional[float]]]" = OrderedDict()
        self._refused: "OrderedDict[str, float]" = OrderedDict()  # seconds past the deadline
        self._confirmable: "OrderedDict[str, None]" = OrderedDict()  # P answers whether it holds R

    def __len__(self) -> int:
        return len(self._leases) + len(self._refused)

    def arrive(self, req_id: str, deadline: Optional[float], expiry: Optional[float] = None,
               confirmable: bool = False) -> int:
        """Note R's lease (``confirmable``: P offered to confirm R's READ); returns how many
        entries the cap pushed out."""
        self.forget(req_id)
        self._leases[req_id] = (deadline, expiry)
        if confirmable:
            self._confirmable[req_id] = None
            while len(self._confirmable) > self.cap:
                self._confirmable.popitem(last=False)
        evicted = 0
        while len(self) > self.cap:
            (self._leases if self._leases else self._refused).popitem(last=False)
            evicted += 1
        return evicted

    def judge(self, req_id: str, now: float, prefill_now: Optional[float] = None) -> Optional[float]:
        """R's lease is relied on now: seconds past its end if it is refused (within the
        margin counts as past), None if trusted, unknown, or not decidable here (see
        :func:`seconds_late`; it stays to be judged). Judged once."""
        lease = self._leases.get(req_id)
        if lease is None:
            return self._refused.get(req_id)
        late = seconds_late(*lease, now, prefill_now)
        if late is None:
            return None
        del self._leases[req_id]
        if late + self.margin_s >= 0:
            self._refused[req_id] = late
            return late
        return None

    def take_refusal(self, req_id: str, now: float, prefill_now: Optional[float] = None) -> Optional[float]:
        """R's READ is being shipped: judge it if not yet, and hand out a refusal once."""
        self.judge(req_id, now, prefill_now)
        return self._refused.pop(req_id, None)

    def take_confirmable(self, req_id: str) -> Optional[Tuple[Optional[float], Optional[float]]]:
        """R's READ leaves and P offered to confirm it: R's lease (for a worker that cannot keep
        the READ's notification after all), once; None if P did not offer."""
        if req_id not in self._confirmable:
            return None
        del self._confirmable[req_id]
        lease = self._leases.pop(req_id, None)
        self._refused.pop(req_id, None)
        return lease or (None, None)

    def hand_over(self, req_id: str) -> Optional[Tuple[Optional[float], Optional[float]]]:
        """R's READ leaves with its lease not decidable here: ``(deadline, expiry)`` for the
        worker to judge, once."""
        return self._leases.pop(req_id, None)

    def pending(self):
        """Requests arrived and not judged yet."""
        return list(self._leases)

    def forget(self, req_id: str) -> None:
        self._leases.pop(req_id, None)
        self._refused.pop(req_id, None)
        self._confirmable.pop(req_id, None)


class PrefillClocks:
    """D's scheduler: each worker rank's offset to each prefill's clock (P's perf_counter
    minus D's), from the ranks' answers; a rank's answer replaces its earlier one. A prefill's
    clock is known here only once every rank (``ranks``) reported it: only then does every
    rank's heartbeat to it leave. The largest offset is used (P's clock read later, so leases
    end sooner: the safe side). At most ``cap`` ranks (the oldest answer is dropped)."""

    def __init__(self, ranks: int, cap: int = 256) -> None:
        self.ranks = max(int(ranks), 1)
        self.cap = cap
        self._by_rank: "OrderedDict[str, Dict[str, float]]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_rank)

    def heard(self, clocks_by_rank) -> None:
        for rank, offsets in (clocks_by_rank or {}).items():
            self._by_rank.pop(rank, None)
            self._by_rank[rank] = {str(e): float(o) for e, o in dict(offsets).items()}
        while len(self._by_rank) > self.cap:
            self._by_rank.popitem(last=False)

    def now_on(self, engine_id, now: float) -> Optional[float]:
        """P's clock now (``now``: D's perf_counter), or None while not every rank knows it."""
        offsets = [o[engine_id] for o in self._by_rank.values() if engine_id in o]
        return now + max(offsets) if offsets and len(offsets) >= self.ranks else None


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


def _clocks(nixl_scheduler) -> PrefillClocks:
    return state_of(nixl_scheduler, "_hotfix_lease_clocks",
                    lambda: PrefillClocks(_scheduler_half(nixl_scheduler).ranks))


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
            params[EXPIRY_KEY] = round(expires, 3)  # the clock P's handshake listener reports
            params[DEADLINE_KEY] = round(time.time() + (expires - time.perf_counter()), 3)
            _count("deadline_exported")
            if HELD.listening and confirm_timeout_s() > 0:
                if HELD.hold(request.request_id):
                    _count("held_evicted")
                params[CONFIRM_KEY] = CONFIRM_WIRE
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
    raw, raw_expiry = params.get(DEADLINE_KEY), params.get(EXPIRY_KEY)
    if raw is None and raw_expiry is None:
        _count("deadline_missing")
        log.once((FIX, "deadline_missing"), "warning", "hotfix.lease.no_deadline", fix=FIX,
                 req_id=req_id, remote_engine_id=params.get("remote_engine_id"),
                 reason=f"kv_transfer_params carry no {DEADLINE_KEY}: the prefill node runs "
                 "without lease-guard, or the router drops the key",
                 action="stock READ for such requests (counted as deadline_missing)")
        return
    deadline, expiry = parse_deadline(raw), parse_deadline(raw_expiry)
    if (raw is not None and deadline is None) or (raw_expiry is not None and expiry is None):
        _count("deadline_garbled")
        log.limited((FIX, "deadline_garbled"), "error", "hotfix.lease.bad_deadline", fix=FIX,
                    req_id=req_id, value=repr((raw, raw_expiry))[:80],
                    reason=f"{DEADLINE_KEY} or {EXPIRY_KEY} is not a positive number of seconds",
                    action="stock READ for this request")
        return
    confirmable = params.get(CONFIRM_KEY) == CONFIRM_WIRE and confirm_timeout_s() > 0
    if _book(nixl_scheduler).arrive(req_id, deadline, expiry, confirmable):
        _count("book_evicted")


def refuse_reads_of_lapsed_leases(wrapped, instance, args, kwargs):
    """D: judge each lease when D first relies on it (a heartbeat that leaves, or the READ
    leaving now), on P's clock; mark the READs of refused ones, hand the ones not decidable
    here to the worker, and stamp the handshake."""
    metadata = wrapped(*args, **kwargs)
    if not _reads_by_pull(instance):
        return metadata  # push mode: no worker half could answer, so no handshake either
    try:
        half = _scheduler_half(instance)
        half.stamp(metadata)
        book = instance.__dict__.get("_hotfix_leases")
        if book is not None and len(book):
            now, perf, clocks = time.time(), time.perf_counter(), _clocks(instance)
            if getattr(metadata, "heartbeat_by_engine", None):
                _judge_at_heartbeats_that_leave(instance, book, clocks, now, perf)
            for req_id, req_meta in metadata.reqs_to_recv.items():
                engine = req_meta.remote.engine_id if req_meta.remote else None
                confirm = book.take_confirmable(req_id)
                if confirm is not None and half.may_act and _has_blocks(req_meta.local_block_ids):
                    setattr(req_meta, CONFIRM_ATTR, confirm)  # P decides, once the READ is done
                    continue
                late = book.take_refusal(req_id, now, clocks.now_on(engine, perf))
                if not (half.may_act and _has_blocks(req_meta.local_block_ids)):
                    book.hand_over(req_id)
                elif late is not None:
                    setattr(req_meta, REFUSED_ATTR, round(late, 3))
                    _refused(req_id, engine, late, book.margin_s, "scheduler")
                else:
                    lease = book.hand_over(req_id)
                    if lease is not None:  # first contact: the worker judges it after the handshake
                        setattr(req_meta, LEASE_ATTR, lease)
    except Exception as exc:
        contain(FIX, "NixlBaseConnectorScheduler.build_connector_meta", exc,
                fallback="this step's READs are sent unjudged (stock)")
        halves.give_up(instance, "_hotfix_lease_half", f"build_connector_meta failed: {exc}")
    return metadata


def _judge_at_heartbeats_that_leave(nixl_scheduler, book: LeaseBook, clocks: PrefillClocks,
                                    now: float, perf: float) -> None:
    """A heartbeat for R leaves only to a prefill every worker rank has a handshake with (NIXL
    skips the others): from then on D renews R's lease, so it is judged now, on P's clock."""
    engines = nixl_scheduler._heartbeat_req_engine  # req_id -> (engine id, P's request id)
    for req_id in book.pending():
        engine = engines.get(req_id)
        prefill_now = clocks.now_on(engine[0] if isinstance(engine, tuple) else engine, perf)
        if prefill_now is not None:
            book.judge(req_id, now, prefill_now)


def _refused(req_id: str, engine, late: float, margin_s: float, where: str) -> None:
    _count("lease_expired_refused")
    log.limited((FIX, "expired_refused"), "warning", "hotfix.lease.expired_refused",
                fix=FIX, req_id=req_id, remote_engine_id=engine, judged_by=where,
                seconds_past_deadline=round(late, 3), margin_s=margin_s,
                action="the READ is declined before any byte moves: a failed "
                "remote load (kv_load_failure_policy decides)")


def _reads_by_pull(nixl_scheduler) -> bool:
    """NIXL's pull scheduler: D READs from P (the only mode with a READ to judge; in push
    mode P writes into D and no pull worker exists to announce a worker half)."""
    pull = getattr(sys.modules.get(f"{_NIXL}.pull_scheduler"), "NixlPullConnectorScheduler", None)
    return pull is not None and isinstance(nixl_scheduler, pull)


def _has_blocks(block_ids) -> bool:
    ids = list(block_ids or ())
    return any(len(g) for g in ids) if ids and isinstance(ids[0], (list, tuple)) else bool(ids)


def hear_the_worker_halves(wrapped, instance, args, kwargs):
    """The first connector output decides whether every worker rank has the worker half;
    every output may carry the ranks' offsets to prefill clocks."""
    try:
        scheduler = instance.connector_scheduler
        sent = getattr(argument(args, kwargs, 0, "connector_output"), "finished_sending", None)
        if sent and len(HELD):
            HELD.release(sent)  # P frees these blocks in this step: no longer held for a READ
        if scheduler is not None and _reads_by_pull(scheduler):
            meta = getattr(argument(args, kwargs, 0, "connector_output"), "kv_connector_worker_meta", None)
            _scheduler_half(scheduler).heard(meta)
            if getattr(meta, "prefill_clocks", None):
                _clocks(scheduler).heard(meta.prefill_clocks)
    except Exception as exc:
        contain(FIX, "NixlBaseConnector.update_connector_output", exc,
                fallback="lease-guard degraded in this engine")
    return wrapped(*args, **kwargs)


def answer_whether_blocks_are_held(wrapped, instance, args, kwargs):
    """P: vLLM's handshake listener serves its metadata map; ours also answers whether this
    EngineCore still holds a request's blocks (the thread runs in the process that frees them)."""
    try:
        if confirm_timeout_s() > 0:
            metadata = argument(args, kwargs, 0, "encoded_data")
            if "encoded_data" in kwargs:
                kwargs = dict(kwargs, encoded_data=HeldOrMetadata(metadata))
            else:
                args = (HeldOrMetadata(metadata),) + tuple(args[1:])
            HELD.listening = True
    except Exception as exc:
        contain(FIX, "NixlBaseConnectorScheduler._nixl_handshake_listener", exc,
                fallback="this prefill does not offer to confirm its leases")
    return wrapped(*args, **kwargs)


# ---------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------

def decline_reads_of_lapsed_leases(wrapped, instance, args, kwargs):
    """A READ the EngineCore refused, or one whose lease it left to the worker (the first
    contact with that prefill) and that has lapsed on P's clock, fails before any byte moves,
    as vLLM fails an expired turn-2 readback; everything else is NIXL's own READ."""
    try:
        req_id = argument(args, kwargs, 0, "req_id")
        meta = argument(args, kwargs, 1, "meta")
        lease = getattr(meta, CONFIRM_ATTR, None)
        if lease is not None and _can_keep_the_notification(instance, meta):
            return _read_keeping_the_notification(instance, wrapped, args, kwargs, req_id, meta)
        late = getattr(meta, REFUSED_ATTR, None)
        if late is None:
            late = _refused_where_posted(instance, req_id, meta, lease)
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


def _refused_where_posted(worker, req_id: str, meta, lease=None) -> Optional[float]:
    """The lease the EngineCore could not judge (or left to P's confirmation, which cannot be
    had here after all), judged here, after the handshake: on P's clock with the offset vLLM
    measured in it (the wall-clock deadline only without one)."""
    lease = lease or getattr(meta, LEASE_ATTR, None)
    if not lease:
        return None
    deadline, expiry = lease
    engine = meta.remote.engine_id if meta.remote else None
    offset = getattr(worker, "_engine_clock_offset", {}).get(engine)
    now = time.time()
    late = seconds_late(deadline, expiry, now, None if offset is None else time.perf_counter() + offset)
    if late is None:
        late = seconds_late(deadline, None, now, None)
    margin = config.seconds(MARGIN_VAR, DEFAULT_MARGIN_S)
    if late is None or late + margin < 0:
        return None
    _refused(req_id, engine, late, margin, "worker")
    return round(late, 3)


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


def _confirmations(worker) -> PrefillConfirmations:
    return state_of(worker, "_hotfix_lease_confirms", lambda: PrefillConfirmations(
        Asker(_asking_with(_get_meta_msg(), confirm_timeout_s())), patience_s=confirm_patience_s(),
        pause_s=confirm_timeout_s(), on_asked_again=lambda n: status.count(FIX, "confirm_asked_again", n)))


def confirm_patience_s() -> float:
    """How long D's worker keeps asking a prefill that is there but silent: a stalled
    EngineCore answers late and its READ is then right, so the worker asks as long as the
    load may take (``HOTFIX_LOAD_TIMEOUT_S``: load-bound fails the request first); with
    load-bound off or unbounded, 0: one question. (The worker cannot see whether load-bound
    applied in its EngineCore; the wait is bounded either way.)"""
    if config.fix_mode(load_bound.SPEC.toggle) == "off":
        return 0.0
    return load_bound.timeout_s() or 0.0


def _asking_with(get_meta_msg, timeout_s: float):
    return lambda address, remote_ids: _lease_confirm.ask_over_zmq(address, get_meta_msg, remote_ids, timeout_s)


def _get_meta_msg():
    return sys.modules[f"{_NIXL}.metadata"].GET_META_MSG


def _can_keep_the_notification(worker, meta) -> bool:
    remote = meta.remote
    return (remote is not None and confirm_timeout_s() > 0 and bool(remote.host) and bool(remote.port)
            and remote.engine_id in getattr(worker, "_remote_agents", {})
            and _confirmations(worker).has_room())


class _NotificationKeeper:
    """The worker's NIXL agent while it posts one READ to be confirmed: the READ is posted
    without its completion notification, which is kept (with the prefill agent it goes to)."""

    def __init__(self, agent, worker, engine_id) -> None:
        self._agent, self._worker, self._engine_id = agent, worker, engine_id
        self.kept: list = []

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def make_prepped_xfer(self, operation, local_xfer_side, local_indices, remote_xfer_side,
                          remote_indices, notif_msg=b"", *rest, **kwargs):
        target = _prefill_agent(self._worker, self._engine_id, remote_xfer_side) if (
            operation == "READ" and notif_msg) else None
        if target is not None:
            self.kept.append((target, notif_msg))
            notif_msg = b""
        return self._agent.make_prepped_xfer(operation, local_xfer_side, local_indices, remote_xfer_side,
                                             remote_indices, notif_msg, *rest, **kwargs)


def _prefill_agent(worker, engine_id, remote_handle) -> Optional[str]:
    """The prefill agent a READ through ``remote_handle`` notifies (vLLM's own pairing)."""
    agents = worker._remote_agents.get(engine_id) or {}
    for rank, handle in (worker.dst_xfer_side_handles.get(engine_id) or {}).items():
        if handle == remote_handle:
            return agents.get((0, rank)) or agents.get(rank)
    return None


def _read_keeping_the_notification(worker, wrapped, args, kwargs, req_id: str, meta):
    """NIXL's own READ, posted without its completion notification; the READ is then kept
    until P confirms it (:func:`report_reads_once_the_prefill_confirmed`)."""
    agent = worker.nixl_wrapper
    keeper = _NotificationKeeper(agent, worker, meta.remote.engine_id)
    worker.nixl_wrapper = keeper
    try:
        result = wrapped(*args, **kwargs)
    finally:
        worker.nixl_wrapper = agent
    try:
        if keeper.kept and req_id in worker._recving_transfers:
            _confirmations(worker).expect(req_id, (str(meta.remote.host), int(meta.remote.port)),
                                          meta.remote.request_id, keeper.kept)
            _count("read_to_confirm")
        elif keeper.kept:  # not posted after all: nothing was read, nothing to notify
            pass
        else:
            _count("confirm_skipped")
            log.limited((FIX, "confirm_skipped"), "warning", "hotfix.lease.confirm_skipped", fix=FIX,
                        req_id=req_id, reason="the READ's notification could not be paired with a "
                        "prefill agent", action="this READ is reported as NIXL reports it (stock)")
    except Exception as exc:
        _send(worker, keeper.kept)
        contain(FIX, _READ_TARGET, exc, fallback="this READ is reported as NIXL reports it (stock)")
    return result


def report_reads_once_the_prefill_confirmed(wrapped, instance, args, kwargs):
    """A READ kept for confirmation that NIXL reports done is held back and P is asked; on P's
    yes it is reported done and its notification sent; on a no or no answer it fails through
    vLLM's failed-load path. A READ that failed on its own is vLLM's to report."""
    result = wrapped(*args, **kwargs)
    confirmations = instance.__dict__.get("_hotfix_lease_confirms")
    if not confirmations:
        return result
    done = result[0] if isinstance(result, tuple) else result
    try:
        if argument(args, kwargs, 0, "transfers") is not instance._recving_transfers:
            return result
        failed = result[1] if isinstance(result, tuple) else _queued(instance._failed_recv_reqs)
        finished = [r for r in done if r in confirmations]
        for req_id in finished:
            if req_id in failed:
                confirmations.forget(req_id)
            else:
                done.discard(req_id)
        confirmations.ask(finished)
        for req_id, held, notifs in confirmations.answered():
            if held:
                _send(instance, notifs)
                done.add(req_id)
                _count("read_confirmed")
            else:
                if held is None:  # P may still hold the blocks: let it free them
                    _send(instance, notifs)
                _unconfirmed(instance, req_id, held)
    except Exception as exc:
        contain(FIX, "NixlBaseConnectorWorker._pop_done_transfers", exc,
                fallback="the READs kept for confirmation are reported as NIXL reported them")
        _give_back_unconfirmed(instance, done)
    return result


def _unconfirmed(worker, req_id: str, held: Optional[bool]) -> None:
    kind = "confirm_unanswered" if held is None else "read_unconfirmed"
    _count(kind)
    log.limited((FIX, kind), "warning", "hotfix.lease.read_unconfirmed", fix=FIX, req_id=req_id,
                reason="the prefill had released the blocks before or during the READ" if held is False
                else "the prefill did not answer (nothing listens at its side channel, or it "
                f"was silent for {max(confirm_patience_s(), confirm_timeout_s())} s of asking)",
                action="the load fails: kv_load_failure_policy decides")
    _fail_before_reading(worker, req_id)


def _give_back_unconfirmed(worker, done) -> None:
    try:
        confirmations = worker.__dict__.get("_hotfix_lease_confirms")
        for req_id in [r for r in list(confirmations._reads) if r not in worker._recving_transfers]:
            _send(worker, confirmations.forget(req_id))
            done.add(req_id)
    except Exception as exc:
        log.limited((FIX, "give_back"), "error", "hotfix.runtime.error", fix=FIX, target="give_back",
                    reason=f"{type(exc).__name__}: {exc}", fallback="none")


def _send(worker, notifs) -> None:
    for agent_name, notif_msg in notifs:
        try:
            worker.nixl_wrapper.send_notif(agent_name, notif_msg=notif_msg)
        except Exception as exc:
            log.limited((FIX, "notif_failed"), "warning", "hotfix.lease.notification_failed", fix=FIX,
                        agent=agent_name, reason=f"{type(exc).__name__}: {exc}",
                        action="the prefill frees the blocks when its lease ends")


def _queued(failed_queue) -> set:
    with failed_queue.mutex:
        return set(failed_queue.queue)


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
            report = state_of(instance, "_hotfix_lease_clocks", ClockReport)
            changed = report.changed(getattr(instance.connector_worker, "_engine_clock_offset", {}),
                                     getattr(bound, "scheduler_clock", 0.0) or 0.0)
            return answer_with(meta, present=half.presence(),
                               prefill_clocks={half.token: changed} if changed is not None else None)
    except Exception as exc:
        contain(FIX, "KVConnectorBase_V1.build_connector_worker_meta", exc,
                fallback="no announcement this step")
    return meta


class ClockReport:
    """One worker rank: the offsets to prefill clocks it last reported to its EngineCore.

    vLLM measures each offset against this worker's perf_counter in the NIXL handshake; the
    EngineCore's clock differs from it by the least gap seen between a step's
    ``scheduler_clock`` and this worker reading it (0 plus a delivery delay on one host: a
    larger offset, the safe side). Reported again only when a prefill comes or goes or an
    offset moves by more than ``tolerance_s``. Bounded by the handshakes vLLM keeps."""

    def __init__(self, tolerance_s: float = 0.05) -> None:
        self.tolerance_s = tolerance_s
        self.gap: Optional[float] = None
        self.last: Dict[str, float] = {}

    def changed(self, offsets, scheduler_clock: float) -> Optional[Dict[str, float]]:
        if scheduler_clock > 0:
            gap = time.perf_counter() - scheduler_clock
            self.gap = gap if self.gap is None else min(self.gap, gap)
        now = {str(e): round(float(o) + (self.gap or 0.0), 3) for e, o in dict(offsets).items()}
        if now.keys() == self.last.keys() and all(
                abs(now[e] - self.last[e]) <= self.tolerance_s for e in now):
            return None
        self.last = now
        return now


def _count(kind: str) -> None:
    status.count(FIX, kind)
