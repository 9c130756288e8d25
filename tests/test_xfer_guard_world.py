"""xfer-guard in the scheduler world: the cases of upstream.md §4.2 and D4, each red on
stock (asserted) and survived with the fix; the hold ledger frees blocks exactly once."""
from __future__ import annotations

from dataclasses import replace

import pytest

from hotfix import status
from hotfix.fixes import xfer_guard
from hotfix.worlds import scenarios
from hotfix.worlds.scheduler_world import INFLIGHT_LIMIT_SUPPORTED
from hotfix.worlds.tracker import COMPUTE_WHILE_LOADING, READ_FROM_FREED, WRITE_INTO_FREED
from tests.worlds.verdicts import delivered_at, finished, run_fixed, run_stock, verdicts

FIX = "xfer-guard"
IN_REQUESTS = "assert req_id in self.requests"
IS_FINISHED = "assert RequestStatus.is_finished(req.status)"


def counted(kind: str) -> int:
    return status.counters().get(FIX, {}).get(kind, 0)


def survived(result):
    assert result.crash is None, result.crash.traceback


@pytest.mark.parametrize("scenario", ["ABORT_SAVE_FIRST_ALL_SAVED", "ABORT_NIXL_FIRST_ALL_SAVED",
                                      "ABORT_SAME_STEP"])
def test_d4_two_holders_free_the_blocks_once_after_the_last_release(scenario):
    scenario = getattr(scenarios, scenario)
    stock = run_stock(scenario)
    assert stock.crash.source_line == IN_REQUESTS
    assert stock.tracker.of_kind(WRITE_INTO_FREED) or stock.tracker.of_kind(READ_FROM_FREED) or \
        "finished_sending" in stock.crash.enclosing_loop()

    fixed, states = run_fixed(scenario, FIX)
    assert states[FIX]["state"] == "applied"
    survived(fixed)
    assert fixed.violations == []  # no early free under either party, every block came back
    ledger = fixed.world.scheduler.__dict__["_hotfix_holds"]
    assert len(ledger) == 0  # no entry outlives the blocks it guarded


def test_late_recv_after_free_is_dropped_with_an_error_not_an_engine_death():
    before = counted("recv_unknown")
    stock = run_stock(scenarios.RECV_FOR_FREED_REQUEST)
    assert stock.crash.source_line == IN_REQUESTS

    fixed, _ = run_fixed(scenarios.RECV_FOR_FREED_REQUEST, FIX)
    survived(fixed)
    assert finished(fixed, "B")[1] == "length"
    assert counted("recv_unknown") == before + 1


def test_duplicate_recv_while_running_never_frees_and_is_reported():
    before = counted("recv_live")
    stock = run_stock(scenarios.LATE_REPORT_WHILE_RUNNING)
    assert stock.crash.source_line == IS_FINISHED

    fixed, _ = run_fixed(scenarios.LATE_REPORT_WHILE_RUNNING, FIX)
    survived(fixed)
    assert counted("recv_live") == before + 1
    assert finished(fixed, "R")[1] == "length"  # R decoded to the end on its own blocks


def test_live_recv_can_fail_the_request_instead(monkeypatch):
    monkeypatch.setenv("HOTFIX_XFER_GUARD_LIVE_RECV", "fail")
    fixed, _ = run_fixed(scenarios.LATE_REPORT_WHILE_RUNNING, FIX)
    survived(fixed)
    step, reason = finished(fixed, "R")
    assert reason == "error" and step == 5  # the step after NIXL's late report (4)


@pytest.mark.parametrize(("scenario", "kind"), [("SEND_FOR_LIVE_REQUEST", "send_live"),
                                               ("SEND_FOR_FREED_REQUEST", "send_unknown")])
def test_send_report_for_a_live_or_freed_request_is_dropped(scenario, kind):
    scenario = getattr(scenarios, scenario)
    before = counted(kind)
    stock = run_stock(scenario)
    assert stock.crash is not None and isinstance(stock.crash.exc, AssertionError)

    fixed, _ = run_fixed(scenario, FIX)
    survived(fixed)
    assert fixed.violations == []
    assert finished(fixed, "R")[1] == "length"
    assert counted(kind) == before + 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_bug_report_ordering_survives_but_early_promotion_remains_without_recv_barrier(async_scheduling):
    """The honest boundary: xfer-guard alone keeps the engine alive; only recv-barrier
    stops R from computing over blocks NIXL is still writing."""
    scenario = replace(scenarios.LATE_REPORT_AFTER_FREE, async_scheduling=async_scheduling)
    stock = run_stock(scenario)
    assert stock.crash.source_line == IN_REQUESTS

    fixed, _ = run_fixed(scenario, FIX)
    survived(fixed)
    assert fixed.tracker.of_kind(COMPUTE_WHILE_LOADING)  # D1 still happens
    assert fixed.tracker.of_kind(WRITE_INTO_FREED)  # and D3's write into freed blocks

    both, _ = run_fixed(scenario, FIX, "recv-barrier")
    survived(both)
    assert both.violations == []


def test_normal_completions_pass_through_untouched():
    for scenario in (scenarios.SINGLE_LOADER, scenarios.SAME_STEP_REPORTS):
        stock = run_stock(scenario)
        fixed, _ = run_fixed(scenario, FIX)
        assert verdicts(fixed) == verdicts(stock) == (None, [])
        assert delivered_at(fixed, "R") == delivered_at(stock, "R")


def test_strict_mode_raises_on_an_abnormal_report(monkeypatch):
    monkeypatch.setenv("HOTFIX_STRICT", "1")
    fixed, _ = run_fixed(scenarios.RECV_FOR_FREED_REQUEST, FIX)
    assert type(fixed.crash.exc).__name__ == "Violation"
    assert "recv_unknown" in str(fixed.crash.exc)


def test_toggled_off_behaves_exactly_like_stock(monkeypatch):
    monkeypatch.setenv("HOTFIX_XFER_GUARD", "off")
    for scenario in (scenarios.LATE_REPORT_AFTER_FREE, scenarios.ABORT_SAVE_FIRST):
        fixed, states = run_fixed(scenario, FIX)
        assert states[FIX]["state"] == "skipped"
        assert verdicts(fixed) == verdicts(run_stock(scenario))


@pytest.mark.skipif(not INFLIGHT_LIMIT_SUPPORTED, reason="no --max-num-inflight-kv-loads before vLLM 0.34")
def test_a_load_that_ended_under_a_save_hold_gives_its_inflight_slot_back(monkeypatch):
    """vLLM 0.34, one in-flight KV load at most: R is aborted, NIXL's report comes while the
    async save still holds R's blocks (D4; stock dies on it). The fix keeps the report from
    vLLM's free but gives R's in-flight slot back as vLLM does when it sees the report: S's
    load starts on arrival and S finishes; nothing is left in ``_aborted_kv_loads``."""
    scenario = scenarios.ABORT_NIXL_FIRST_ALL_SAVED_THEN_S
    stock = run_stock(scenario)
    assert stock.crash.source_line == IN_REQUESTS

    fixed, _ = run_fixed(scenario, FIX)
    survived(fixed)
    assert fixed.violations == [] and fixed.world.scheduler._aborted_kv_loads == set()
    assert fixed.step(6).status["S"] == "WAITING_FOR_REMOTE_KVS" and finished(fixed, "S")[1] == "length"

    # the red of the slot's release: without it R holds the only slot for good, S never loads
    monkeypatch.setattr(xfer_guard, "_end_the_aborted_load", lambda scheduler, req_id: None)
    wedged, _ = run_fixed(scenario, FIX)
    assert wedged.world.scheduler._aborted_kv_loads == {"R"}
    assert {s.status.get("S") for s in wedged.steps} == {None, "WAITING"}
