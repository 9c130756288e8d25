"""pull-pin (D3): a NIXL decode node never returns a block to the pool under a running READ.

On a decode node NIXL's ``request_finished`` returns ``(False, None)`` whatever its READ is
doing, so a request that finishes, is aborted, preempted or failed while the READ runs gives
its blocks back to the pool and the UCX write lands in another request's KV (a late failure
even reports ``invalid_block_ids`` that now belong to others). NIXL cannot cancel a READ.

The fix pins the READ's target blocks for exactly the READ's lifetime, as an extra block
reference rather than a different answer from ``request_finished`` (returning True would
make MultiConnector count NIXL as an async save, vllm-targets.md §0.4 pitfall 5):
- scheduler side, when NIXL queues a real READ (``update_state_after_alloc`` with local
  blocks), each target block gets one more reference; whatever vLLM then frees (finish,
  abort, preemption, load-failure handling), those blocks stay out of the free queue;
- worker side, NIXL's *own* terminal report of R (done or failed, no handle left) is sent
  to the scheduler in ``kv_connector_worker_meta``, which survives TP aggregation;
- when every worker rank (PP x TP x PCP: each runs its part of the READ) confirmed, the
  references are dropped, per KV-cache group, into the pool that owns the group's blocks.
The halves agree first (``hotfix.halves``): no pin is taken before every worker rank
announced its half, and no worker sends our metadata to an EngineCore that did not
announce its own; a missing half leaves NIXL exactly stock in that engine. Confirmations
carry the stamp epoch the worker had bound, so two READs under one request id (an early
free, then the id again) are each released by the report that covers them. While pins
exist the engine keeps stepping (``Scheduler.has_requests``), so an idle engine still
hears NIXL's reports and releases within one step. No timer ever drops a pin. It holds no
request state, so it needs no hold-ledger entry and composes with bidirectional transfer.
"""
from __future__ import annotations

import contextvars
from typing import Dict, List

from hotfix import halves, status
from hotfix.fixes._blocks import pool_of_group
from hotfix.fixes._nixl_answer import NixlWorkerAnswer, answer_with
from hotfix.fixes._pin_prefix import count_common_prefix_without_pins, track  # noqa: F401
from hotfix.halves import SchedulerHalf, WorkerHalf
from hotfix.runtime import argument, contain, state_of
from hotfix.fixes._scheduler_shapes import HAS_REQUESTS, UPDATE_FROM_OUTPUT
from hotfix.registry import LEAVE, FixSpec, Metric, Shape, Target

_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_SCHED = "vllm.v1.core.sched.scheduler"

SPEC = FixSpec(
    id="pull-pin",
    toggle="HOTFIX_PULL_PIN",
    title="a NIXL decode node keeps a READ's blocks out of the pool until NIXL reports it done",
    defects=("D3",),
    targets=(
        Target(f"{_NIXL}.pull_scheduler", "NixlPullConnectorScheduler.update_state_after_alloc",
               "pin_blocks_of_real_reads", "engine_core",
               {"5b95cfaa8f8d358e": Shape("0.27.0-0.28.0"), "17bba4b6576911f0": Shape("0.29.0"),
                "c490edd3f45db800": Shape("0.30.0-0.33.0"),
                "5f3be1681607c195": Shape("0.34.0")}),
        Target(f"{_NIXL}.connector", "NixlBaseConnector.build_connector_meta",
               "stamp_the_scheduler_half", "engine_core", {"0d4a615e13939e19": Shape("0.27.0-0.34.0")}),
        Target(f"{_NIXL}.base_scheduler", "NixlBaseConnectorScheduler.update_connector_output",
               "unpin_when_every_rank_confirmed", "engine_core",
               {"3a4a7f3be1b34144": Shape("0.27.0-0.34.0")}),
        Target(_SCHED, "Scheduler.update_from_output", "settle_halves_and_release_pins", "engine_core",
               UPDATE_FROM_OUTPUT),
        Target(_SCHED, "Scheduler.has_requests", "keep_stepping_while_pinned", "engine_core",
               HAS_REQUESTS),
        Target("vllm.v1.core.block_pool", "BlockPool.free_blocks", "", "engine_core",
               {"bcc09ebb07f7af42": Shape("0.27.0-0.27.1", LEAVE), "1e2af14b39d63d1b": Shape("0.28.0-0.29.0", LEAVE),
                "10f5c8a60ecccb38": Shape("0.30.0-0.32.0", LEAVE), "56430160427df640": Shape("0.33.0", LEAVE),
                "2eaa7985625222b6": Shape("0.34.0", LEAVE)}),
        Target("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_num_common_prefix_blocks",
               "count_common_prefix_without_pins", "engine_core",
               {"c37ce0826e0e5525": Shape("0.27.0-0.31.0"), "d0147ed76b19dfd4": Shape("0.32.0-0.33.0", LEAVE)},
               may_be_absent=True),  # 0.34 removed it with SchedulerOutput.num_common_prefix_blocks
        Target(f"{_NIXL}.connector", "NixlBaseConnector.get_finished", "note_terminal_reads", "worker",
               {"2c82fee3df9147d2": Shape("0.27.0-0.28.0, 0.30.0-0.34.0"), "ae377c3666894a42": Shape("0.29.0")}),
        Target(f"{_NIXL}.connector", "NixlBaseConnector.get_transfer_results", "note_terminal_reads",
               "worker", {"53b7bb852685dca0": Shape("0.30.0-0.34.0")}, may_be_absent=True),
        Target("vllm.distributed.kv_transfer.kv_connector.v1.base",
               "KVConnectorBase_V1.build_connector_worker_meta", "report_terminal_reads", "worker",
               {"1396ed1bf292744b": Shape("0.27.0-0.34.0")}),
    ),
    upstream="vllm-project/vllm#56104 (report only after every handle is terminal); the seed "
    "report's 'pin blocks of in-flight pulls' direction",
    remove_when="NIXL's decode side keeps blocks of an in-flight READ allocated until the READ "
    "is terminal, in every vLLM release the fleet runs",
    metrics=(
        Metric("vllm:hotfix_blocks_pinned", "KV blocks kept out of the pool for a running NIXL READ",
               ("blocks_pinned",)),
        Metric("vllm:hotfix_blocks_released", "Pinned KV blocks returned to the pool once every "
               "rank's NIXL reported the READ terminal", ("blocks_released",)),
        Metric("vllm:hotfix_blocks_pinned_now", "KV blocks pinned now", ("blocks_pinned_now",),
               gauge=True, alert="stays > 0 at idle: a READ never reported terminal"),
    ),
)

FIX = SPEC.id


class _Pin:
    __slots__ = ("groups", "epoch", "confirmed_by")

    def __init__(self, groups: tuple, epoch: int) -> None:
        self.groups = groups  # per KV-cache group: the KVCacheBlock objects the READ writes
        self.epoch = epoch  # the stamp epoch of the metadata that carries this READ
        self.confirmed_by: set = set()  # rank tokens whose NIXL reported the READ terminal


class PinBook:
    """Per NIXL scheduler: the open pins by request id, oldest first.

    Lifecycle of a pin: :meth:`add` when NIXL queues a READ; :meth:`confirm` by each rank's
    terminal report that covers it (a report at epoch ``e`` covers the READs bound up to
    ``e``); once every rank confirmed it moves to ``ready`` and is released into its pools.
    Bounded by the block pool: every pin holds at least one block.
    """

    def __init__(self) -> None:
        self._pins: Dict[str, List[_Pin]] = {}
        self.ready: List[_Pin] = []  # confirmed, waiting for a block pool to release into

    def __len__(self) -> int:
        return sum(len(p) for p in self._pins.values()) + len(self.ready)

    def pinned(self, req_id: str) -> bool:
        return bool(self._pins.get(req_id))

    def holding(self):
        """Every pin still holding its references (open, or confirmed but not yet released)."""
        for pins in self._pins.values():
            yield from pins
        yield from self.ready

    def release_all(self) -> None:
        """The handshake failed: every provisional pin goes back (stock behaviour)."""
        for pins in self._pins.values():
            self.ready.extend(pins)
        self._pins.clear()

    def add(self, req_id: str, pin: _Pin) -> None:
        self._pins.setdefault(req_id, []).append(pin)

    def confirm(self, req_id: str, rank: str, epoch: int, ranks: int) -> int:
        """Rank ``rank`` reported R terminal at ``epoch``; returns how many pins became ready."""
        pins = self._pins.get(req_id)
        if not pins:
            return 0
        still = []
        for pin in pins:
            if pin.epoch <= epoch:
                pin.confirmed_by.add(rank)
            if len(pin.confirmed_by) >= ranks:
                self.ready.append(pin)
            else:
                still.append(pin)
        released = len(pins) - len(still)
        if still:
            self._pins[req_id] = still
        else:
            del self._pins[req_id]
        return released


# ---------------------------------------------------------------------------------------
# Scheduler side (EngineCore)
# ---------------------------------------------------------------------------------------

_KV_CACHE_MANAGER: contextvars.ContextVar = contextvars.ContextVar("hotfix_pull_pin_kv", default=None)


def _book(nixl_scheduler) -> PinBook:
    return state_of(nixl_scheduler, "_hotfix_pins", lambda: track(PinBook()))


def _scheduler_half(nixl_scheduler) -> SchedulerHalf:
    return state_of(nixl_scheduler, "_hotfix_half", lambda: SchedulerHalf.for_engine(
        FIX, nixl_scheduler.vllm_config.parallel_config))


def _targets_per_group(local_block_ids, groups: int) -> list:
    """NIXL's local block ids as one set per KV-cache group (ids are unique only in a group)."""
    ids = list(local_block_ids or ())
    if ids and not isinstance(ids[0], (list, tuple)):
        ids = [ids]  # a flat list: one group
    return [set(ids[g]) if g < len(ids) else set() for g in range(groups)]


def pin_blocks_of_real_reads(wrapped, instance, args, kwargs):
    """NIXL queued a READ into R's blocks: one more reference on each, until NIXL is done."""
    result = wrapped(*args, **kwargs)
    try:
        half = _scheduler_half(instance)
        request = argument(args, kwargs, 0, "request")
        if half.may_act and argument(args, kwargs, 2, "num_external_tokens") > 0:
            entry = instance._reqs_need_recv.get(request.request_id)
            per_group = argument(args, kwargs, 1, "blocks").blocks
            targets = _targets_per_group(entry[1] if entry else (), len(per_group))
            groups = tuple([b for b in blocks if b.block_id in wanted and not b.is_null]
                           for blocks, wanted in zip(per_group, targets))
            if any(groups):
                for block in (b for group in groups for b in group):
                    block.ref_cnt += 1  # allocated to R right now, so never in the free queue
                _book(instance).add(request.request_id, _Pin(groups, half.epoch + 1))
                _count("pinned")
                _blocks_pinned_now(sum(len(g) for g in groups))
    except Exception as exc:
        contain(FIX, "NixlPullConnectorScheduler.update_state_after_alloc", exc,
                fallback="this READ is not pinned (stock behaviour)")
    return result


def stamp_the_scheduler_half(wrapped, instance, args, kwargs):
    """Every step's NIXL metadata says the EngineCore's half is here (and agreed or not)."""
    metadata = wrapped(*args, **kwargs)
    try:
        scheduler = instance.connector_scheduler
        if scheduler is not None:
            _scheduler_half(scheduler).stamp(metadata)
    except Exception as exc:
        contain(FIX, "NixlBaseConnector.build_connector_meta", exc,
                fallback="pull-pin degraded in this engine (its pins go back at the next output)")
        halves.give_up(instance.__dict__.get("connector_scheduler"), "_hotfix_half", f"stamp failed: {exc}")
    return metadata


def unpin_when_every_rank_confirmed(wrapped, instance, args, kwargs):
    """The workers' halves answered: decide the handshake, then drop confirmed pins."""
    try:
        meta = getattr(argument(args, kwargs, 0, "connector_output"), "kv_connector_worker_meta", None)
        half = _scheduler_half(instance)
        half.heard(meta)
        if half.may_act and isinstance(meta, NixlWorkerAnswer) and meta.confirmed:
            book = _book(instance)
            for req_id, ranks in meta.confirmed.items():
                for rank, epoch in ranks.items():
                    book.confirm(req_id, rank, epoch, half.ranks)
            _release_ready(book)
    except Exception as exc:
        contain(FIX, "NixlBaseConnectorScheduler.update_connector_output", exc,
                fallback="pins kept (blocks stay out of the pool)")
    return wrapped(*args, **kwargs)


def _release_ready(book: PinBook) -> None:
    manager = _KV_CACHE_MANAGER.get()
    if manager is None:
        return  # released on the next call that lends us the pools
    while book.ready:
        pin = book.ready.pop()
        for group, blocks in enumerate(pin.groups):
            if blocks:
                pool_of_group(manager, group).free_blocks(blocks)
        _count("released")
        _blocks_pinned_now(-sum(len(g) for g in pin.groups))


def settle_halves_and_release_pins(wrapped, instance, args, kwargs):
    """NIXL's scheduler learns of confirmations inside this call: lend it the pools. After
    the first output, a handshake nobody answered is degraded and its provisional pins go."""
    token = _KV_CACHE_MANAGER.set(instance.kv_cache_manager)
    try:
        result = wrapped(*args, **kwargs)
        try:
            for nixl_scheduler in _nixl_schedulers(instance.connector):
                half = _scheduler_half(nixl_scheduler)
                half.heard(None)  # no-op once decided
                if not half.may_act:
                    book = _book(nixl_scheduler)
                    book.release_all()
                    _release_ready(book)
        except Exception as exc:
            contain(FIX, "Scheduler.update_from_output", exc,
                    fallback="pins kept until the next output")
        return result
    finally:
        _KV_CACHE_MANAGER.reset(token)


def keep_stepping_while_pinned(wrapped, instance, args, kwargs):
    """An idle engine keeps stepping while we hold blocks, so NIXL's reports still arrive
    (as vLLM does for its own delayed frees); it stops once nothing is pinned."""
    if wrapped(*args, **kwargs):
        return True
    try:
        return any(len(nixl_scheduler.__dict__.get("_hotfix_pins") or ())
                   for nixl_scheduler in _nixl_schedulers(instance.connector))
    except Exception as exc:
        contain(FIX, "Scheduler.has_requests", exc, fallback="stock answer (pins wait for traffic)")
        return False


def _nixl_schedulers(connector) -> list:
    """The NIXL scheduler objects under a connector (MultiConnector or NIXL itself)."""
    if connector is None:
        return []
    found = []
    for child in getattr(connector, "_connectors", None) or (connector,):
        nixl_scheduler = getattr(child, "connector_scheduler", None)
        if nixl_scheduler is not None and hasattr(nixl_scheduler, "_reqs_need_recv"):
            found.append(nixl_scheduler)
    return found


# ---------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------

class _WorkerReads:
    """One rank's NIXL reports: ``unsettled`` (handles still open), ``done`` (to ship)."""

    __slots__ = ("half", "unsettled", "done")

    def __init__(self) -> None:
        self.half = WorkerHalf(FIX)
        self.unsettled: set = set()
        self.done: Dict[str, int] = {}  # req_id -> stamp epoch it was settled at


def note_terminal_reads(wrapped, instance, args, kwargs):
    """Record what NIXL itself reports finished (done or failed) with no handle left."""
    result = wrapped(*args, **kwargs)
    try:
        reads = state_of(instance, "_hotfix_reads", _WorkerReads)
        metadata = getattr(instance, "_connector_metadata", None)
        if metadata is not None:
            reads.half.bound(metadata)
        if reads.half.may_ship:
            recving = result[1] if isinstance(result, tuple) else result.finished_recving
            handles = getattr(instance.connector_worker, "_recving_transfers", None) or {}
            reads.unsettled.update(recving or ())
            settled = {r for r in reads.unsettled if not handles.get(r)}
            reads.unsettled -= settled
            for req_id in settled:
                reads.done[req_id] = reads.half.epoch
    except Exception as exc:
        contain(FIX, "NixlBaseConnector worker entry point", exc,
                fallback="confirmation delayed (blocks stay pinned)")
    return result


def report_terminal_reads(wrapped, instance, args, kwargs):
    """Ship this step's confirmations and announcement, only to an EngineCore that announced
    it reads them, in the step's NIXL answer (the base method, NIXL's, returns none itself)."""
    meta = wrapped(*args, **kwargs)
    reads = instance.__dict__.get("_hotfix_reads")
    if reads is None or not reads.half.may_ship:
        return meta
    present = reads.half.presence()
    if not present and not reads.done:
        return meta
    done, reads.done = reads.done, {}
    token = reads.half.token
    return answer_with(meta, {req_id: {token: epoch} for req_id, epoch in done.items()}, present)


_pinned_block_refs = [0]  # this process's pins' block references, for the status gauge


def _blocks_pinned_now(change: int) -> None:
    _pinned_block_refs[0] += change
    status.count(FIX, "blocks_pinned" if change > 0 else "blocks_released", abs(change))
    status.gauge(FIX, "blocks_pinned_now", _pinned_block_refs[0])


def _count(kind: str) -> None:
    status.count(FIX, kind)
