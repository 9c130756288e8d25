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
- when every TP rank confirmed, the references are dropped (``BlockPool.free_blocks``).
No timer ever drops a pin. It works alone and with the other fixes; it holds no request
state, so it needs no hold-ledger entry and composes with bidirectional transfer.
"""
from __future__ import annotations

import contextvars
from typing import Dict, List

from hotfix import status
from hotfix.fixes._pin_prefix import count_common_prefix_without_pins, track  # noqa: F401
from hotfix.runtime import argument, contain, state_of
from hotfix.registry import LEAVE, FixSpec, Shape, Target

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
                "c490edd3f45db800": Shape("0.30.0-0.33.0")}),
        Target(f"{_NIXL}.base_scheduler", "NixlBaseConnectorScheduler.update_connector_output",
               "unpin_when_every_rank_confirmed", "engine_core",
               {"3a4a7f3be1b34144": Shape("0.27.0-0.33.0")}),
        Target(_SCHED, "Scheduler._update_from_kv_xfer_finished", "lend_block_pool", "engine_core",
               {"258ebbc0d940084d": Shape("0.27.0-0.31.0"), "10edd450e3d6daa5": Shape("0.32.0-0.33.0")}),
        Target("vllm.v1.core.block_pool", "BlockPool.free_blocks", "", "engine_core",
               {"bcc09ebb07f7af42": Shape("0.27.0-0.27.1", LEAVE), "1e2af14b39d63d1b": Shape("0.28.0-0.29.0", LEAVE),
                "10f5c8a60ecccb38": Shape("0.30.0-0.32.0", LEAVE), "56430160427df640": Shape("0.33.0", LEAVE)}),
        Target("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_num_common_prefix_blocks",
               "count_common_prefix_without_pins", "engine_core",
               {"c37ce0826e0e5525": Shape("0.27.0-0.31.0"), "d0147ed76b19dfd4": Shape("0.32.0-0.33.0", LEAVE)}),
        Target(f"{_NIXL}.connector", "NixlBaseConnector.get_finished", "note_terminal_reads", "worker",
               {"2c82fee3df9147d2": Shape("0.27.0-0.28.0, 0.30.0-0.33.0"), "ae377c3666894a42": Shape("0.29.0")}),
        Target(f"{_NIXL}.connector", "NixlBaseConnector.get_transfer_results", "note_terminal_reads",
               "worker", {"53b7bb852685dca0": Shape("0.30.0-0.33.0")}, may_be_absent=True),
        Target("vllm.distributed.kv_transfer.kv_connector.v1.base",
               "KVConnectorBase_V1.build_connector_worker_meta", "report_terminal_reads", "worker",
               {"1396ed1bf292744b": Shape("0.27.0-0.33.0")}),
    ),
    upstream="vllm-project/vllm#56104 (report only after every handle is terminal); the seed "
    "report's 'pin blocks of in-flight pulls' direction",
    remove_when="NIXL's decode side keeps blocks of an in-flight READ allocated until the READ "
    "is terminal, in every vLLM release the fleet runs",
)

FIX = SPEC.id


class ReadsConfirmed:
    """Worker → scheduler: NIXL's own terminal reports, per request, summed over TP ranks.

    Travels as (part of) ``kv_connector_worker_meta``; ``KVOutputAggregator`` and
    ``MultiKVConnectorWorkerMetadata`` combine ranks with :meth:`aggregate`.
    """

    def __init__(self, counts: Dict[str, int]) -> None:
        self.counts = dict(counts)

    def aggregate(self, other: "ReadsConfirmed") -> "ReadsConfirmed":
        merged = dict(self.counts)
        for req_id, n in getattr(other, "counts", {}).items():
            merged[req_id] = merged.get(req_id, 0) + n
        return ReadsConfirmed(merged)


class _Pin:
    __slots__ = ("blocks", "expected", "confirmed")

    def __init__(self, blocks: list, expected: int) -> None:
        self.blocks = blocks  # KVCacheBlock objects the READ writes into
        self.expected = expected  # TP ranks that each run a part of the READ
        self.confirmed = 0


class PinBook:
    """Per NIXL scheduler: the open pins by request, oldest first; bounded by the pool size
    (a pin holds at least one block, and blocks are finite)."""

    def __init__(self) -> None:
        self._pins: Dict[str, List[_Pin]] = {}
        self.ready: List[_Pin] = []  # confirmed, waiting for a block pool to release into

    def __len__(self) -> int:
        return sum(len(p) for p in self._pins.values())

    def pinned(self, req_id: str) -> bool:
        return bool(self._pins.get(req_id))

    def add(self, req_id: str, pin: _Pin) -> None:
        self._pins.setdefault(req_id, []).append(pin)

    def confirm(self, req_id: str, ranks: int) -> bool:
        """``ranks`` more ranks finished R's oldest READ; True if that READ is now released."""
        pins = self._pins.get(req_id)
        if not pins:
            return False
        pin = pins[0]
        pin.confirmed += ranks
        if pin.confirmed < pin.expected:
            return False
        pins.pop(0)
        if not pins:
            del self._pins[req_id]
        self.ready.append(pin)
        return True


# ---------------------------------------------------------------------------------------
# Scheduler side (EngineCore)
# ---------------------------------------------------------------------------------------

_BLOCK_POOL: contextvars.ContextVar = contextvars.ContextVar("hotfix_pull_pin_pool", default=None)


def _book(nixl_scheduler) -> PinBook:
    return state_of(nixl_scheduler, "_hotfix_pins", lambda: track(PinBook()))


def _block_ids(block_ids) -> set:
    """NIXL's local block ids: one list per KV-cache group (or a flat list)."""
    ids = set()
    for group in block_ids or ():
        if isinstance(group, (list, tuple)):
            ids.update(group)
        else:
            ids.add(group)
    return ids


def pin_blocks_of_real_reads(wrapped, instance, args, kwargs):
    """NIXL queued a READ into R's blocks: one more reference on each, until NIXL is done."""
    result = wrapped(*args, **kwargs)
    try:
        request = argument(args, kwargs, 0, "request")
        if argument(args, kwargs, 2, "num_external_tokens") > 0:
            entry = instance._reqs_need_recv.get(request.request_id)
            targets = _block_ids(entry[1]) if entry else set()
            if targets:
                blocks = [b for group in argument(args, kwargs, 1, "blocks").blocks for b in group
                          if b.block_id in targets and not b.is_null]
                for block in blocks:  # allocated to R right now, so never in the free queue
                    block.ref_cnt += 1
                tp = instance.vllm_config.parallel_config.tensor_parallel_size
                _book(instance).add(request.request_id, _Pin(blocks, tp))
                _count("pinned")
    except Exception as exc:
        contain(FIX, "NixlPullConnectorScheduler.update_state_after_alloc", exc,
                fallback="this READ is not pinned (stock behaviour)")
    return result


def unpin_when_every_rank_confirmed(wrapped, instance, args, kwargs):
    """NIXL's workers confirmed R's READ terminal on every rank: drop the pin."""
    try:
        meta = getattr(argument(args, kwargs, 0, "connector_output"), "kv_connector_worker_meta", None)
        if isinstance(meta, ReadsConfirmed):
            book = _book(instance)
            for req_id, ranks in meta.counts.items():
                book.confirm(req_id, ranks)
            _release_ready(book)
    except Exception as exc:
        contain(FIX, "NixlBaseConnectorScheduler.update_connector_output", exc,
                fallback="pins kept (blocks stay out of the pool)")
    return wrapped(*args, **kwargs)


def _release_ready(book: PinBook) -> None:
    pool = _BLOCK_POOL.get()
    if pool is None:
        return  # released on the next call that lends us the pool
    while book.ready:
        pin = book.ready.pop()
        pool.free_blocks(pin.blocks)
        _count("released")


def lend_block_pool(wrapped, instance, args, kwargs):
    """NIXL's scheduler learns of confirmations inside this call; let it release into the pool."""
    token = _BLOCK_POOL.set(instance.kv_cache_manager.block_pool)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _BLOCK_POOL.reset(token)


# ---------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------

def _no_reads() -> dict:
    """Reads NIXL reported terminal: ``done`` (to ship), ``unsettled`` (handles still open)."""
    return {"done": set(), "unsettled": set()}


def note_terminal_reads(wrapped, instance, args, kwargs):
    """Record what NIXL itself reports finished (done or failed) with no handle left."""
    result = wrapped(*args, **kwargs)
    try:
        recving = result[1] if isinstance(result, tuple) else result.finished_recving
        state = state_of(instance, "_hotfix_reads", _no_reads)  # no allocation once it exists
        handles = getattr(instance.connector_worker, "_recving_transfers", None) or {}
        state["unsettled"].update(recving or ())
        settled = {r for r in state["unsettled"] if not handles.get(r)}
        state["unsettled"] -= settled
        state["done"] |= settled
    except Exception as exc:
        contain(FIX, "NixlBaseConnector worker entry point", exc,
                fallback="confirmation delayed (blocks stay pinned)")
    return result


def report_terminal_reads(wrapped, instance, args, kwargs):
    """Ship this step's confirmations; the base method (NIXL's) returns no metadata itself."""
    meta = wrapped(*args, **kwargs)
    state = instance.__dict__.get("_hotfix_reads")
    if meta is None and state and state["done"]:
        done, state["done"] = state["done"], set()
        return ReadsConfirmed({req_id: 1 for req_id in done})
    return meta


def _count(kind: str) -> None:
    status.count(FIX, kind)
