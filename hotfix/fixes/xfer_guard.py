"""xfer-guard (D2, D4): no completion report kills the EngineCore; blocks are freed once.

``Scheduler._update_from_kv_xfer_finished`` asserts on every report it does not expect, and
one assert ends the EngineCore (``EngineDeadError``; with DP, every rank). It also frees a
finished request's blocks at the first report even when two parties hold them (an abort's
recv hold and a connector's async save), so the second party's transfer runs on freed blocks
and its report asserts (D4).

The fix classifies each reported id as in ``reference/upstream.md`` §4.2, hands vLLM's own
method only the ids it can handle safely (so its bookkeeping, e.g. ``_set_kv_fetch_stage`` on
0.32+, keeps running) and lets the connector's ``update_connector_output`` still see every
report. Every abnormal id is one ERROR line (``hotfix.xfer.unexpected``) and a counter;
``HOTFIX_STRICT=1`` raises after logging. Holds are counted in the hold ledger: the blocks
go back once, when the last holder releases.

This is containment, not the root fix: an early promotion (D1) still happens with this fix
alone; recv-barrier prevents it.
"""
from __future__ import annotations

import copy

from hotfix.fixes._holds import KEPT, LAST, NOT_HELD, RECV, SAVE, UNKNOWN, ledger_of
from hotfix import log, status
from hotfix.runtime import argument, contain, violation
from hotfix.registry import FixSpec, Metric, Shape, Target

_SCHED = "vllm.v1.core.sched.scheduler"

SPEC = FixSpec(
    id="xfer-guard",
    toggle="HOTFIX_XFER_GUARD",
    title="the scheduler survives stale/duplicate transfer reports; held blocks are freed once",
    defects=("D2", "D4"),
    targets=(
        Target(_SCHED, "Scheduler._update_from_kv_xfer_finished", "never_crash_on_completion_reports",
               "engine_core", {"258ebbc0d940084d": Shape("0.27.0-0.31.0"),
                               "10edd450e3d6daa5": Shape("0.32.0-0.33.0"),
                               "340177406d94690e": Shape("0.34.0")}),
        Target(_SCHED, "Scheduler._free_request", "record_recv_hold", "engine_core",
               {"089bebeee85b5b65": Shape("0.27.0-0.30.0"), "5472117665cf9edd": Shape("0.31.0"),
                "ea27e496d62572fd": Shape("0.32.0"), "dad394decfa6caf8": Shape("0.33.0"),
                "c09359056358e874": Shape("0.34.0")}),
        Target(_SCHED, "Scheduler._connector_finished", "record_save_hold", "engine_core",
               {"9277683870127b9a": Shape("0.27.0-0.29.0"),
                "ffa9ce548418c4d4": Shape("0.30.0-0.34.0")}),
        Target(_SCHED, "Scheduler._free_blocks", "forget_holds_when_freed", "engine_core",
               {"e4bd589cacadf6d4": Shape("0.27.0-0.34.0")}),
    ),
    upstream="vllm-project/vllm#56089 (refcounted delayed frees); #53079, #56194 (late reports)",
    remove_when="the scheduler counts delayed-free holders and no longer asserts on stale "
    "KV-transfer reports in every vLLM release the fleet runs",
    metrics=(
        Metric("vllm:hotfix_unexpected_completions_dropped", "KV-transfer completion reports stock "
               "vLLM would assert on (or free a live request's blocks for), dropped",
               ("recv_unknown", "recv_live", "send_unknown", "send_live", "recv_not_owed",
                "save_not_owed", "pull_not_owed"), by_kind=True,
               alert="rate > 0: each one was an EngineCore death on stock; recv_live may mean "
               "corrupt KV of a running request"),
        Metric("vllm:hotfix_requests_held", "Finished requests whose blocks wait for a transfer "
               "report (the hold ledger, now)", ("requests_held",), gauge=True,
               alert="stays > 0 at idle: a transfer never reported (blocks out of the pool)"),
    ),
)

FIX = SPEC.id
LIVE_RECV_VAR = "HOTFIX_XFER_GUARD_LIVE_RECV"  # log (default) | fail


def never_crash_on_completion_reports(wrapped, instance, args, kwargs):
    """Filter the reports vLLM would assert on or free wrongly, then delegate."""
    output = argument(args, kwargs, 0, "kv_connector_output")
    recving = output.finished_recving or ()
    sending = output.finished_sending or ()
    if not recving and not sending:  # the common step: nothing to classify
        return wrapped(*args, **kwargs)
    try:
        keep_recv, keep_send, problems = _triage(instance, recving, sending)
    except Exception as exc:
        contain(FIX, "Scheduler._update_from_kv_xfer_finished", exc,
                fallback="stock handling of this step's reports")
        return wrapped(*args, **kwargs)
    if problems:
        violation("; ".join(problems))
    if len(keep_recv) == len(recving) and len(keep_send) == len(sending):
        return wrapped(*args, **kwargs)
    filtered = copy.copy(output)
    filtered.finished_recving = keep_recv or None
    filtered.finished_sending = keep_send or None
    connector = instance.connector
    if connector is not None:
        instance.connector = _sees_every_report(connector, output)
    try:
        return wrapped(filtered)
    finally:
        instance.connector = connector


def _triage(scheduler, recving, sending):
    """(recv ids to hand vLLM, send ids to hand vLLM, problems) per upstream.md §4.2."""
    from vllm.v1.request import RequestStatus

    ledger = ledger_of(scheduler)
    keep_recv, keep_send, problems = set(), set(), []
    for req_id in recving:
        request = scheduler.requests.get(req_id)
        if request is None:  # case 3: freed already; a duplicate, or a late write landed
            problems.append(_unexpected("recv_unknown", req_id, None, "finished_recving"))
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:  # case 1: normal
            keep_recv.add(req_id)
        elif RequestStatus.is_finished(request.status):  # case 2 (and 8)
            if _released(ledger, req_id, RECV, request, "finished_recving", problems):
                keep_recv.add(req_id)
            else:
                _end_the_aborted_load(scheduler, req_id)
        else:  # case 4: live request; another loader may have written its blocks
            problems.append(_unexpected("recv_live", req_id, request.status, "finished_recving",
                                        note="KV of this request may be corrupt"))
            _fail_if_configured(scheduler, req_id)
    for req_id in sending:
        request = scheduler.requests.get(req_id)
        if request is None:  # case 6
            problems.append(_unexpected("send_unknown", req_id, None, "finished_sending"))
        elif not RequestStatus.is_finished(request.status):  # case 7: never free a live request
            problems.append(_unexpected("send_live", req_id, request.status, "finished_sending"))
        elif _released(ledger, req_id, SAVE, request, "finished_sending", problems):  # case 5 (8)
            keep_send.add(req_id)
    return keep_recv, keep_send, problems


def _end_the_aborted_load(scheduler, req_id: str) -> None:
    """The load of an aborted request ended, though its blocks stay held (an async save): free
    its in-flight slot as vLLM does when it sees the report itself (0.34+:
    ``_aborted_kv_loads`` counts against ``max_num_inflight_kv_loads``; kept, it is a leak
    and, under the cap, every later async load waits for ever)."""
    aborted = getattr(scheduler, "_aborted_kv_loads", None)
    if aborted is not None:
        aborted.discard(req_id)


def _released(ledger, req_id, party, request, kind, problems) -> bool:
    """Release ``party``'s hold; True when vLLM should free now (the last holder let go)."""
    outcome = ledger.release(req_id, party)
    if outcome in (LAST, UNKNOWN):  # UNKNOWN: a hold we did not see taken; stock behaviour
        return True
    if outcome == KEPT:
        _count(f"hold_released_{party}")
        _log("info", "hotfix.hold.released", req_id=req_id, party=party,
             remaining=list(ledger.holders(req_id)))
        return False
    assert outcome == NOT_HELD
    problems.append(_unexpected(f"{party}_not_owed", req_id, request.status, kind,
                                holders=list(ledger.holders(req_id))))
    return False


def _unexpected(kind: str, req_id: str, status, report: str, **extra) -> str:
    _count(kind)
    log.limited((FIX, kind), "error", "hotfix.xfer.unexpected", fix=FIX, kind=kind,
                req_id=req_id, status=str(status) if status is not None else "freed",
                list=report, action="dropped", **extra)
    return f"{kind}: {report} for {req_id} (status {status})"


def _fail_if_configured(scheduler, req_id: str) -> None:
    """``HOTFIX_XFER_GUARD_LIVE_RECV=fail``: finish the request with an error next step."""
    from hotfix import config

    if config.choice(LIVE_RECV_VAR, ("log", "fail"), "log") != "fail":
        return
    errors = scheduler.grammar_compile_error_reqs  # vLLM's "finish with an error output" queue
    if isinstance(errors, set):
        errors.add(req_id)
    else:  # 0.33: {req_id: RequestError}
        from vllm.outputs import RequestError

        errors[req_id] = RequestError(code="kv_load_error",
                                      message="KV cache of this request may be corrupt")
    _count("live_recv_failed")


_PROXY_CLASS = None


def _sees_every_report(connector, full_output):
    """The scheduler's connector, handed the unfiltered output by vLLM's own method."""
    global _PROXY_CLASS
    if _PROXY_CLASS is None:
        from hotfix import _deps

        class SeesEveryReport(_deps.wrapt().ObjectProxy):
            def __init__(self, wrapped, output):
                super().__init__(wrapped)
                self._self_output = output

            def update_connector_output(self, _filtered):
                return self.__wrapped__.update_connector_output(self._self_output)

        _PROXY_CLASS = SeesEveryReport
    return _PROXY_CLASS(connector, full_output)


def record_recv_hold(wrapped, instance, args, kwargs):
    """``_free_request(..., delay_free_blocks=True)``: the scheduler waits for a recv."""
    result = wrapped(*args, **kwargs)
    try:
        request = args[0] if args else kwargs["request"]
        delayed = kwargs.get("delay_free_blocks", args[1] if len(args) > 1 else False)
        if delayed and request.request_id in instance.requests:
            ledger_of(instance).hold(request.request_id, RECV)
            _report_evictions(instance)
            _gauge_holds(instance)
    except Exception as exc:
        contain(FIX, "Scheduler._free_request", exc, fallback="stock single-hold freeing")
    return result


def record_save_hold(wrapped, instance, args, kwargs):
    """``_connector_finished`` said the connector saves asynchronously: it holds the blocks."""
    delay, params = result = wrapped(*args, **kwargs)
    if delay:
        try:
            request = args[0] if args else kwargs["request"]
            ledger_of(instance).hold(request.request_id, SAVE)
            _report_evictions(instance)
            _gauge_holds(instance)
        except Exception as exc:
            contain(FIX, "Scheduler._connector_finished", exc, fallback="stock single-hold freeing")
    return result


def forget_holds_when_freed(wrapped, instance, args, kwargs):
    """vLLM frees the request's blocks: its ledger entry ends with them."""
    result = wrapped(*args, **kwargs)
    ledger = instance.__dict__.get("_hotfix_holds")
    if ledger is not None:
        try:
            ledger.forget((args[0] if args else kwargs["request"]).request_id)
            _gauge_holds(instance)
        except Exception as exc:
            contain(FIX, "Scheduler._free_blocks", exc, fallback="ledger entry kept")
    return result


def _report_evictions(scheduler) -> None:
    ledger = ledger_of(scheduler)
    while ledger.evicted:
        req_id = ledger.evicted.pop()
        _count("hold_evicted")
        _log("error", "hotfix.hold.evicted", req_id=req_id, cap=ledger.cap,
             reason="too many held requests; this one falls back to stock single-hold freeing")


def _gauge_holds(scheduler) -> None:
    status.gauge(FIX, "requests_held", len(ledger_of(scheduler)))


def _count(kind: str) -> None:
    status.count(FIX, kind)


def _log(level: str, event: str, **fields) -> None:
    log.emit(level, event, fix=FIX, **fields)
