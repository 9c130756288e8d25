"""nixl-settle (D7): NIXL reports a receive once, after the last of its READ handles is terminal.

On vLLM 0.27-0.29 a decode worker whose READ of R is split over several handles (P's TP >
D's TP: one READ per prefill rank) reports R as soon as *one* remote fails — a handle in
``ERR``, a READ that could not be set up — through ``_failed_recv_reqs``, while the other
handles keep running; ``get_finished`` then pops R's receive metadata. When the remaining
handles finish, ``_pop_done_transfers`` returns R a second time and NIXL's own worker trips
``assert meta is not None, f"{req_id} not found in recving_metadata list"`` (base_worker.py
L2081 on 0.27.1): the worker dies, and with it the EngineCore. 0.30.0 fixed this upstream:
failures are held (``_recv_failures``) until the request has no handle left.

The fix does the same on 0.27-0.29, filter-and-delegate at the point where vLLM polls the
receive handles (``_pop_done_transfers(self._recving_transfers)``, just before
``get_finished`` drains the failure queue): a failed request that still has handles in
flight is taken out of the queue and held; it is put back, once, in the poll after its last
handle became terminal, so ``get_finished`` reports it once, as failed (no KV post-processing,
its metadata popped once). Everything else in the queue is put back untouched, and vLLM's
own code does all the polling, releasing and reporting. The failed blocks are still reported
at the failure (``get_block_ids_with_load_errors``, unchanged): the scheduler marks R failed
then and acts on the single completion report (policy ``recompute``: keeps R waiting;
``fail``: ends R with an error, its blocks held by the recv hold until that report).

A failed handshake is not this defect: it fails R before any READ handle exists, so vLLM
reports it once (tests/test_nixl_settle_world.py shows it).

State: the held ids, a subset of the requests with handles in ``_recving_transfers`` (pruned
every poll), so bounded by the in-flight READs. Safe fallback on an internal error: put every
drained id back (stock behaviour for this step).
"""
from __future__ import annotations

import queue

from hotfix import log, status
from hotfix.runtime import argument, contain, state_of
from hotfix.registry import FIXED, LEAVE, FixSpec, Metric, Shape, Target

_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
_CLS = "NixlBaseConnectorWorker"

SPEC = FixSpec(
    id="nixl-settle",
    toggle="HOTFIX_NIXL_SETTLE",
    title="NIXL reports a split READ once, after its last handle is terminal (no worker assert)",
    defects=("D7",),
    targets=(
        # Where the failure queue is filtered: the poll of the receive handles.
        Target(_WORKER, f"{_CLS}._pop_done_transfers", "settle_failed_reads", "worker",
               {"b9cb3121e5195644": Shape("0.27.0-0.29.0"),
                "ef47a1051a14bd33": Shape("0.30.0-0.34.0 (returns the failed ids)", FIXED)}),
        # Its caller: polls, then drains `_failed_recv_reqs`, then pops metadata and asserts.
        Target(_WORKER, f"{_CLS}.get_finished", "", "worker",
               {"f2e903941d812526": Shape("0.27.0-0.28.0", LEAVE), "9391f5b009a15407": Shape("0.29.0", LEAVE),
                "2777e244d29c0f80": Shape("0.30.0-0.34.0 (delegates to get_transfer_results)", LEAVE)}),
        # What queues a failure (and marks the blocks invalid) without looking at other handles.
        Target(_WORKER, f"{_CLS}._handle_failed_transfer", "", "worker",
               {"50134fb19c89ff3c": Shape("0.27.0-0.29.0", LEAVE), "9560b4fb1f2c26d3": Shape("0.30.0", LEAVE),
                "73807639bc3b7812": Shape("0.31.0", LEAVE), "c2634ba0a6c48177": Shape("0.32.0-0.34.0", LEAVE)}),
        # The upstream fix: failures held in `_recv_failures` until no handle is left.
        Target(_WORKER, f"{_CLS}.get_transfer_results", "", "worker",
               {"a8c23fc4e7a45672": Shape("0.30.0", FIXED), "2f4a36a8195d7c7d": Shape("0.31.0", FIXED),
                "8d68354e00c5e145": Shape("0.32.0-0.33.0", FIXED),
                "a850cefa38a00afe": Shape("0.34.0", FIXED)}, may_be_absent=True),
    ),
    upstream="vLLM 0.30.0 NIXL worker: transfer failures held until the request has no "
    "outstanding handles (`_recv_failures`, `_pop_done_transfers` returns the failed ids)",
    remove_when="the fleet runs only vLLM >= 0.30.0 (status then says fixed_upstream)",
    metrics=(
        Metric("vllm:hotfix_split_read_failures_held", "Failed READs of a split pull held until "
               "their last handle ended (a NIXL worker assert on stock)", ("held",),
               alert="rate > 0: prefill ranks fail READs; each was a worker death on stock"),
    ),
)

FIX = SPEC.id


def settle_failed_reads(wrapped, instance, args, kwargs):
    """Hold back failures of requests whose other READ handles are still in flight."""
    done = wrapped(*args, **kwargs)
    transfers = argument(args, kwargs, 0, "transfers")
    failures = getattr(instance, "_failed_recv_reqs", None)
    if transfers is not getattr(instance, "_recving_transfers", None) or failures is None:
        return done  # the send side (push mode), or a shape we do not know at run time
    held = instance.__dict__.get("_hotfix_settle")
    if not held and failures.empty():
        return done  # the common step: nothing failed, nothing held
    drained = _drain(failures)
    held = state_of(instance, "_hotfix_settle", set)
    try:
        report = _settle(instance, transfers, drained, held)
    except Exception as exc:
        held.difference_update(drained)  # reported now, so never again from here
        report = list(dict.fromkeys(drained))
        contain(FIX, f"{_CLS}._pop_done_transfers", exc,
                fallback="this step's failures reported as stock does")
    for req_id in report:
        failures.put(req_id)
    return done


def _drain(failures) -> list:
    drained = []
    while True:
        try:
            drained.append(failures.get_nowait())
        except queue.Empty:
            return drained


def _settle(worker, transfers, drained: list, held: set) -> list:
    """The failed ids to report now (put back in the queue); the rest stays in ``held``."""
    report = []
    for req_id in dict.fromkeys(drained):  # one failure per request, in queue order
        if transfers.get(req_id):
            if req_id not in held:
                held.add(req_id)
                _count("held")
                log.warning("hotfix.nixl.failure_held", fix=FIX, req_id=req_id,
                            handles_in_flight=len(transfers[req_id]),
                            reason="a READ of a split pull failed; reported once its other handles end")
        else:
            report.append(req_id)
    for req_id in list(held):
        if transfers.get(req_id):
            continue
        held.discard(req_id)
        if req_id not in worker._recving_metadata:  # nothing left to report it against
            _count("dropped")
            log.error("hotfix.nixl.failure_dropped", fix=FIX, req_id=req_id,
                      reason="receive metadata gone before the last handle ended")
            continue
        if req_id not in report:
            report.append(req_id)
        _count("settled")
    return report


def _count(kind: str) -> None:
    status.count(FIX, kind)
