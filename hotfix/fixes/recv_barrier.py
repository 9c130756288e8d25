"""recv-barrier (D1, D5): MultiConnector reports a load once, after every loader is done.

Stock ``MultiConnector`` unions its children's ``finished_recving``. When a non-chosen child
loads anyway (LMCache MP <= 0.5.4, vLLM's in-tree LMCache MP <= 0.29), its report promotes
the request while the chosen NIXL pull is still writing the same blocks (silent wrong
output), and NIXL's later report hits the scheduler's asserts. Sending NIXL the merged set
also stops its heartbeat early (D5).

The fix, per worker and before ``KVOutputAggregator`` (which counts reports per id, not per
connector):
- scheduler side: the child chosen for an *async* load of R travels to the workers in the
  same step's ``MultiKVConnectorMetadata`` (attribute ``hotfix_load_plans``);
- worker side: at bind time we learn which children really start a load into R's blocks
  (NIXL ``reqs_to_recv`` with local blocks, LMCache MP ``RETRIEVE`` ops) and add them;
- the worker entry point forwards R in ``finished_recving`` once that set is empty;
  ``failed_recving`` is held the same way. Reports from children outside the set are
  absorbed, logged once per child class and counted.
D5 follows: the scheduler's merged completions now name R only when every loader of R on
every rank is done, so what ``update_connector_output`` hands NIXL is true for NIXL too.

The halves agree first (``hotfix.halves``): the scheduler stamps each step's metadata, every
worker rank answers in ``kv_connector_worker_meta`` (a ``MultiKVConnectorWorkerMetadata``
that also carries the answer, so an unpatched rank's metadata still merges with it), and if
a rank does not answer the scheduler stops shipping plans: every worker is stock again, not
some ranks barriered and others not.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Set

from hotfix import log, status
from hotfix.halves import SchedulerHalf, WorkerHalf, merge_presence
from hotfix.runtime import argument, contain, state_of
from hotfix.fixes._scheduler_shapes import UPDATE_FROM_OUTPUT
from hotfix.registry import LEAVE, FixSpec, Metric, Shape, Target

_MC = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"
_ALL = "0.27.0-0.34.0"

SPEC = FixSpec(
    id="recv-barrier",
    toggle="HOTFIX_RECV_BARRIER",
    title="MultiConnector forwards a load completion once, after every loader of R is done",
    defects=("D1", "D5"),
    targets=(
        Target(_MC, "MultiKVConnectorMetadata", "", "engine_core",
               {"8071f94e10471a05": Shape(_ALL, action=LEAVE)}),
        Target(_MC, "MultiConnector.update_state_after_alloc", "plan_async_loads", "engine_core",
               {"510c98c55c802135": Shape(_ALL)}),
        Target(_MC, "MultiConnector.build_connector_meta", "ship_load_plans", "engine_core",
               {"7ada026e68f1bb16": Shape(_ALL)}),
        Target(_MC, "MultiConnector.update_connector_output", "hear_the_worker_halves", "engine_core",
               {"c7c272e5ffa44072": Shape(_ALL)}),
        Target("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output",
               "settle_the_handshake", "engine_core",
               UPDATE_FROM_OUTPUT),
        Target(_MC, "MultiKVConnectorWorkerMetadata", "", "worker",
               {"13d58a686600df05": Shape(_ALL, action=LEAVE)}),
        Target(_MC, "MultiConnector.build_connector_worker_meta", "announce_the_worker_half",
               "worker", {"633e94efe00e83bf": Shape(_ALL)}),
        Target(_MC, "MultiConnector.bind_connector_metadata", "learn_loaders_at_bind", "worker",
               {"26ea26c57c649d98": Shape(_ALL)}),
        Target(_MC, "MultiConnector.get_finished", "release_when_all_loaders_done", "worker",
               {"01a2f54ef82852e4": Shape("0.27.0-0.29.0"),
                "4669328ebd618eb8": Shape("0.30.0-0.34.0 (delegates to get_transfer_results)",
                                          action=LEAVE)}),
        Target(_MC, "MultiConnector.get_transfer_results", "release_when_all_loaders_done",
               "worker", {"efd21dc3e74b5952": Shape("0.30.0-0.34.0")}, may_be_absent=True),
    ),
    upstream="vllm-project/vllm#51595, #54240 (load plan + per-child drain in MultiConnector)",
    remove_when="MultiConnector tracks per-child load completion (a load plan shipped in "
    "MultiKVConnectorMetadata) in every vLLM release the fleet runs",
    metrics=(
        Metric("vllm:hotfix_concurrent_loads_held", "Loads by a connector MultiConnector did not "
               "choose into a request's blocks, held until every loader of it was done (the bug "
               "report's race, absorbed; counted per worker rank)", ("concurrent_load_held",),
               alert="rate > 0: a connector loads although not chosen (lmcache <= 0.5.4); stock "
               "vLLM would have promoted early or died"),
        Metric("vllm:hotfix_stray_load_reports_absorbed", "Load reports of a request by a connector "
               "that was not loading it, absorbed", ("stray_report",),
               alert="rate > 0: a connector reports loads it never started"),
    ),
)

FIX = SPEC.id

# Verdicts of LoadBarrier.report
WAIT, DONE, DONE_FAILED, STRAY, ABSORBED = "wait", "done", "done_failed", "stray", "absorbed"


class _Episode:
    __slots__ = ("pending", "planned", "failed")

    def __init__(self, planned: bool) -> None:
        self.pending: Set[int] = set()  # children still writing into R's blocks
        self.planned = planned  # the scheduler waits for exactly one report of R
        self.failed = False


class LoadBarrier:
    """Per-worker ledger of load episodes: which children are still writing R's blocks.

    Lifecycle of an entry: ``plan`` (the scheduler's choice) or ``started`` (a child's bound
    metadata) opens it; each child's terminal ``report`` removes that child; when none is
    left the entry is closed and the verdict says whether to forward R. Bounded: beyond
    ``cap`` open episodes the oldest is evicted and the eviction is returned to the caller,
    who must log it.
    """

    def __init__(self, cap: int = 65536, remember: int = 8192) -> None:
        self.cap = cap
        self.remember = remember
        self._episodes: "OrderedDict[str, _Episode]" = OrderedDict()
        self._forwarded: "OrderedDict[str, None]" = OrderedDict()  # recent, for diagnostics
        self.evicted: list = []

    def __len__(self) -> int:
        return len(self._episodes)

    def pending(self, req_id: str) -> Set[int]:
        episode = self._episodes.get(req_id)
        return set(episode.pending) if episode else set()

    def plan(self, req_id: str, child: int) -> bool:
        """The scheduler chose ``child`` to load R asynchronously: a new episode (L4).

        Returns False when an earlier episode of R still has loaders: they stay in the set,
        so R is forwarded only once everything writing its blocks is done.
        """
        episode = self._episodes.get(req_id)
        fresh = episode is None or not episode.pending
        if fresh:
            episode = self._open(req_id, planned=True)
        episode.planned = True
        episode.pending.add(child)
        self._forwarded.pop(req_id, None)
        return fresh

    def started(self, req_id: str, child: int) -> bool:
        """``child`` starts a load into R's blocks; False if no plan expects R (a stray load)."""
        episode = self._episodes.get(req_id) or self._open(req_id, planned=False)
        episode.pending.add(child)
        return episode.planned

    def report(self, req_id: str, child: int, failed: bool = False) -> str:
        """A child's terminal report for R; the verdict says what to tell the scheduler."""
        episode = self._episodes.get(req_id)
        if episode is None or child not in episode.pending:
            return STRAY
        episode.pending.discard(child)
        episode.failed |= failed
        if episode.pending:
            return WAIT
        del self._episodes[req_id]
        if not episode.planned:
            return ABSORBED
        self._forwarded[req_id] = None
        while len(self._forwarded) > self.remember:
            self._forwarded.popitem(last=False)
        return DONE_FAILED if episode.failed else DONE

    def was_forwarded(self, req_id: str) -> bool:
        return req_id in self._forwarded

    def _open(self, req_id: str, planned: bool) -> _Episode:
        episode = _Episode(planned)
        self._episodes[req_id] = episode
        while len(self._episodes) > self.cap:
            self.evicted.append(self._episodes.popitem(last=False)[0])
        return episode


# ---------------------------------------------------------------------------------------
# Scheduler side (EngineCore)
# ---------------------------------------------------------------------------------------

_PLANS_ATTR = "hotfix_load_plans"  # on MultiKVConnectorMetadata; pickled with it


def plan_async_loads(wrapped, instance, args, kwargs):
    """Remember which child the scheduler chose to load R (``update_state_after_alloc``)."""
    result = wrapped(*args, **kwargs)
    if instance.__dict__.get("_hotfix_degraded"):
        return result  # nothing ships plans any more: keep none (H3)
    try:
        request = argument(args, kwargs, 0, "request")
        if argument(args, kwargs, 2, "num_external_tokens") > 0:
            chosen = instance._requests_to_connector.get(request.request_id)
            if chosen is not None:
                state_of(instance, "_hotfix_unshipped_plans", dict)[request.request_id] = (chosen, request)
    except Exception as exc:
        _degrade_scheduler(instance, "MultiConnector.update_state_after_alloc", exc)
    return result


def _scheduler_half(multi) -> SchedulerHalf:
    return state_of(multi, "_hotfix_half", lambda: SchedulerHalf.for_engine(
        FIX, multi._vllm_config.parallel_config))


def ship_load_plans(wrapped, instance, args, kwargs):
    """Attach this step's async-load plans to the metadata the workers bind, with the stamp."""
    metadata = wrapped(*args, **kwargs)
    if instance.__dict__.get("_hotfix_degraded"):
        instance.__dict__.pop("_hotfix_unshipped_plans", None)  # plans taken before degrading
        return metadata  # no attribute: workers fall back to stock behaviour
    try:
        from vllm.v1.request import RequestStatus

        half = _scheduler_half(instance)
        half.stamp(metadata)
        unshipped = state_of(instance, "_hotfix_unshipped_plans", dict)
        plans = {
            req_id: chosen
            for req_id, (chosen, request) in unshipped.items()
            # async (waiting for the load), or aborted after its load started (0.33 deferred
            # loads start in update_from_output, before this metadata); a sync load is RUNNING
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            or RequestStatus.is_finished(request.status)
        }
        unshipped.clear()
        if half.may_act:
            setattr(metadata, _PLANS_ATTR, plans)
    except Exception as exc:
        _degrade_scheduler(instance, "MultiConnector.build_connector_meta", exc)
        if hasattr(metadata, _PLANS_ATTR):
            delattr(metadata, _PLANS_ATTR)
    return metadata


def hear_the_worker_halves(wrapped, instance, args, kwargs):
    """The workers' answer to the stamp rides in the merged worker metadata."""
    try:
        output = argument(args, kwargs, 0, "connector_output")
        _scheduler_half(instance).heard(getattr(output, "kv_connector_worker_meta", None))
    except Exception as exc:
        _degrade_scheduler(instance, "MultiConnector.update_connector_output", exc)
    return wrapped(*args, **kwargs)


def settle_the_handshake(wrapped, instance, args, kwargs):
    """After the first output: a handshake no worker output answered is degraded."""
    result = wrapped(*args, **kwargs)
    multi = instance.connector
    if multi is not None and "_hotfix_half" in multi.__dict__:
        try:
            multi.__dict__["_hotfix_half"].heard(None)  # no-op once decided
        except Exception as exc:
            _degrade_scheduler(multi, "Scheduler.update_from_output", exc)
    return result


def _degrade_scheduler(instance, target: str, exc: BaseException) -> None:
    """A plan may be lost: stop shipping plans for good, so workers stop waiting on them."""
    instance.__dict__["_hotfix_degraded"] = True
    contain(FIX, target, exc, fallback="stock MultiConnector behaviour from now on")


# ---------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------

def loads_started(child_metadata) -> Set[str]:
    """Requests whose blocks this child's bound metadata starts writing into.

    Shapes read: NIXL ``reqs_to_recv`` ({req_id: meta with ``local_block_ids``}); LMCache MP
    ``requests`` (ops with ``request_id`` and ``direction == "RETRIEVE"``: LMCache's own
    ``lmcache_mp_metadata.LMCacheMPConnectorMetadata``, 0.5.4 and 0.5.6, which vLLM runs when
    lmcache ships it, and vLLM's in-tree copy). A metadata that has either field in another
    form, or an LMCache class with neither, is reported once per class (WARNING): the barrier
    cannot see that child's stray loads, which then behave as on stock.
    """
    recv = getattr(child_metadata, "reqs_to_recv", None)  # NIXL
    if isinstance(recv, dict):
        return {req_id for req_id, meta in recv.items() if _has_blocks(getattr(meta, "local_block_ids", ()))}
    ops = getattr(child_metadata, "requests", None)  # LMCache MP
    if isinstance(ops, (list, tuple)) and all(hasattr(op, "request_id") and hasattr(op, "direction")
                                              for op in ops):
        return {op.request_id for op in ops if _is_retrieve(op.direction)}
    if recv is not None or ops is not None or _looks_like_lmcache(child_metadata):
        cls = type(child_metadata)
        _once(("unreadable", cls.__module__, cls.__qualname__), "warning", "hotfix.recv.unreadable_metadata",
              metadata=f"{cls.__module__}:{cls.__qualname__}",
              reason="neither NIXL reqs_to_recv nor LMCache MP requests of RETRIEVE/STORE ops",
              action="this child's loads are not seen by the barrier (stock behaviour for them)")
    return set()


def _is_retrieve(direction) -> bool:
    """LMCache MP's ``direction`` is the str "RETRIEVE"; an Enum of that name or value counts too."""
    return "RETRIEVE" in (direction, getattr(direction, "name", None), getattr(direction, "value", None))


def _looks_like_lmcache(child_metadata) -> bool:
    cls = type(child_metadata)
    return child_metadata is not None and "lmcache" in f"{cls.__module__}.{cls.__qualname__}".lower()


def _has_blocks(block_ids) -> bool:
    """NIXL block ids are per KV-cache group (lists) or flat; empty means notify-only."""
    return any((len(group) > 0) if isinstance(group, (list, tuple)) else True for group in block_ids)


def learn_loaders_at_bind(wrapped, instance, args, kwargs):
    """Open episodes from the scheduler's plans and from what each child starts loading."""
    result = wrapped(*args, **kwargs)
    barrier = state_of(instance, "_hotfix_barrier", LoadBarrier)
    if instance.__dict__.get("_hotfix_degraded"):
        return result
    try:
        metadata = argument(args, kwargs, 0, "connector_metadata")
        state_of(instance, "_hotfix_half", lambda: WorkerHalf(FIX)).bound(metadata)
        plans = getattr(metadata, _PLANS_ATTR, None)
        instance.__dict__["_hotfix_coordinated"] = plans is not None
        if plans is None:
            return result
        for req_id, chosen in plans.items():
            if not barrier.plan(req_id, chosen):
                _log("warning", "hotfix.recv.overlapping_episode", req_id=req_id,
                     pending=sorted(barrier.pending(req_id)))
        for index, (child, child_md) in enumerate(zip(instance._connectors, metadata.metadata)):
            for req_id in loads_started(child_md):
                joins = index not in barrier.pending(req_id)
                if barrier.started(req_id, index):
                    if joins:  # a loader the scheduler did not choose: the race, held
                        _count("concurrent_load_held")
                    continue
                _count("unplanned_load")
                _once(("unplanned", type(child).__name__), "error", "hotfix.recv.unplanned_load",
                      child=type(child).__name__, req_id=req_id,
                      reason="a child loads into blocks of a request no plan loads asynchronously")
        _report_evictions(barrier)
    except Exception as exc:
        instance.__dict__["_hotfix_degraded"] = True
        contain(FIX, "MultiConnector.bind_connector_metadata", exc,
                fallback="stock MultiConnector behaviour on this worker from now on")
    return result


def release_when_all_loaders_done(wrapped, instance, args, kwargs):
    """The worker entry point: forward R once every loader of its episode is terminal."""
    if instance.__dict__.get("_hotfix_degraded") or not instance.__dict__.get("_hotfix_coordinated"):
        return wrapped(*args, **kwargs)
    try:
        taps = _taps_of(instance)
    except Exception as exc:
        _contain_entry(instance, exc)
        return wrapped(*args, **kwargs)
    originals = instance._connectors
    instance._connectors = taps
    try:
        result = wrapped(*args, **kwargs)
    finally:
        instance._connectors = originals
    try:
        return _apply_barrier(instance, taps, result)
    except Exception as exc:
        _contain_entry(instance, exc)
        return result


def _apply_barrier(instance, taps, result):
    if not any(tap.recving or tap.failed for tap in taps):
        return result  # the common step: no child finished a load
    barrier = state_of(instance, "_hotfix_barrier", LoadBarrier)
    forward: Set[str] = set()
    forward_failed: Set[str] = set()
    for index, tap in enumerate(taps):
        failed = tap.failed
        for req_id in sorted(tap.recving | failed):
            verdict = barrier.report(req_id, index, failed=req_id in failed)
            if verdict == DONE:
                forward.add(req_id)
            elif verdict == DONE_FAILED:
                forward.add(req_id)
                forward_failed.add(req_id)
            elif verdict == STRAY:
                _stray(type(tap.child).__name__, req_id, barrier.was_forwarded(req_id))
            elif verdict == ABSORBED:
                _count("unplanned_load_done")
    if isinstance(result, tuple):  # 0.27 - 0.29: (finished_sending, finished_recving)
        return result[0], (forward or None)
    result.finished_recving = forward
    result.failed_recving = forward_failed
    return result


def _stray(child: str, req_id: str, promoted: bool) -> None:
    _count("stray_report")
    _once(("stray", child), "error", "hotfix.recv.stray", child=child, req_id=req_id,
          promoted=promoted,
          reason="a connector reported a load it was not doing for this request; absorbed")


def _contain_entry(instance, exc: BaseException) -> None:
    instance.__dict__["_hotfix_degraded"] = True
    contain(FIX, "MultiConnector worker entry point", exc,
            fallback="stock MultiConnector behaviour on this worker from now on")


def _report_evictions(barrier: LoadBarrier) -> None:
    while barrier.evicted:
        req_id = barrier.evicted.pop()
        _count("evicted")
        _log("error", "hotfix.recv.evicted", req_id=req_id, cap=barrier.cap,
             reason="too many open load episodes; this request's loads are no longer coordinated")


def _taps_of(instance) -> list:
    """One tap per child, built once per connector and emptied before each step."""
    children = instance._connectors
    cached = instance.__dict__.get("_hotfix_taps")
    if cached is None or cached[0] is not children:
        cached = instance.__dict__["_hotfix_taps"] = (children, [ReportTap(c) for c in children])
    taps = cached[1]
    for tap in taps:
        tap.recving.clear()
        tap.failed.clear()
    return taps


class ReportTap:
    """Stands in for one child during the entry point and records what it reports.

    vLLM's body only calls ``get_finished`` (<= 0.29) or ``get_transfer_results`` (0.30+)
    on its children there; the fingerprints guarantee that body.
    """

    __slots__ = ("child", "recving", "failed")

    def __init__(self, child) -> None:
        self.child = child
        self.recving: Set[str] = set()
        self.failed: Set[str] = set()

    def get_finished(self, finished_req_ids):
        sending, recving = self.child.get_finished(finished_req_ids)
        if recving:
            self.recving.update(recving)
        return sending, recving

    def get_transfer_results(self, finished_req_ids):
        results = self.child.get_transfer_results(finished_req_ids)
        if results.finished_recving:
            self.recving.update(results.finished_recving)
        failed = getattr(results, "failed_recving", None)
        if failed:
            self.failed.update(failed)
        return results


def announce_the_worker_half(wrapped, instance, args, kwargs):
    """Answer the scheduler's stamp in this step's worker metadata (never before the stamp:
    an EngineCore that did not stamp may not be able to unpickle our class)."""
    meta = wrapped(*args, **kwargs)
    half = instance.__dict__.get("_hotfix_half")
    if half is None or not half.presence():
        return meta
    try:
        return _with_presence(meta, len(instance._connectors), half.presence())
    except Exception as exc:
        _contain_entry(instance, exc)
        return meta


def _with_presence(meta, children: int, present):
    carrier = _presence_class()(metadata=tuple(meta.metadata) if meta is not None else (None,) * children)
    carrier.hotfix_present = present
    return carrier


_PRESENCE_CLASS = None


def _presence_class():
    """``MultiKVConnectorWorkerMetadata`` that also carries the workers' answer: MultiConnector
    and an unpatched rank's metadata merge with it as with their own (built lazily: vLLM's
    class exists only once vLLM is imported; picklable as ``recv_barrier.LoadBarrierPresence``)."""
    global _PRESENCE_CLASS
    if _PRESENCE_CLASS is None:
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
            MultiKVConnectorWorkerMetadata)

        def aggregate(self, other):
            merged = MultiKVConnectorWorkerMetadata.aggregate(self, other)
            carrier = type(self)(metadata=merged.metadata)
            carrier.hotfix_present = merge_presence(self.hotfix_present, other)
            return carrier

        _PRESENCE_CLASS = type("LoadBarrierPresence", (MultiKVConnectorWorkerMetadata,), {
            "__module__": __name__, "__qualname__": "LoadBarrierPresence", "aggregate": aggregate,
            "hotfix_present": {}})
    return _PRESENCE_CLASS


def __getattr__(name: str):
    """Unpickling a worker's answer in the EngineCore looks the class up here."""
    if name == "LoadBarrierPresence":
        return _presence_class()
    raise AttributeError(name)


def _count(kind: str) -> None:
    status.count(FIX, kind)


def _once(key, level: str, event: str, **fields) -> None:
    log.once((FIX,) + tuple(key), level, event, fix=FIX, **fields)


def _log(level: str, event: str, **fields) -> None:
    log.emit(level, event, fix=FIX, **fields)
