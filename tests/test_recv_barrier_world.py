"""recv-barrier in the scheduler world: each race is red on stock (asserted), green fixed."""
from __future__ import annotations

from dataclasses import replace

import pytest

from hotfix.worlds import scenarios
from hotfix.worlds.scheduler_world import DEFERRED_LOADS_SUPPORTED, FAILED_RECVS_SUPPORTED
from hotfix.worlds.tracker import COMPUTE_WHILE_LOADING, WRITE_INTO_FREED
from tests.worlds.verdicts import delivered_at, finished, run_fixed, run_stock, verdicts

FIX = "recv-barrier"
IN_REQUESTS = "assert req_id in self.requests"
IS_FINISHED = "assert RequestStatus.is_finished(req.status)"


def assert_clean(result):
    assert result.crash is None, result.crash.traceback
    assert result.violations == []


def nixl_done_at(result, req_id="R") -> int:
    """Last tick at which a NIXL worker reported ``req_id``."""
    return max(s.step for s in result.steps for (child, _), (_, recv) in s.worker_reports.items()
               if child == "nixl" and req_id in recv)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_bug_report_ordering_promotes_only_after_nixl_and_never_asserts(async_scheduling):
    scenario = replace(scenarios.LATE_REPORT_AFTER_FREE, async_scheduling=async_scheduling)
    stock = run_stock(scenario)
    assert stock.crash.source_line == IN_REQUESTS
    assert stock.tracker.of_kind(WRITE_INTO_FREED)

    fixed, states = run_fixed(scenario, FIX)
    assert states[FIX]["state"] == "applied"
    assert_clean(fixed)
    (delivered,) = delivered_at(fixed, "R")  # once, and not before NIXL's own report
    assert delivered >= nixl_done_at(fixed) and fixed.first_computed("R") > delivered
    assert finished(fixed, "R") == (finished(fixed, "R")[0], "length")
    assert type(fixed.world.scheduler).__name__ == ("AsyncScheduler" if async_scheduling else "Scheduler")


def test_late_report_while_running_cannot_happen_because_promotion_waits():
    stock = run_stock(scenarios.LATE_REPORT_WHILE_RUNNING)
    assert stock.crash.source_line == IS_FINISHED

    fixed, _ = run_fixed(scenarios.LATE_REPORT_WHILE_RUNNING, FIX)
    assert_clean(fixed)
    assert delivered_at(fixed, "R") == [4]


def test_early_promotion_over_unwritten_blocks_is_prevented_on_both_ranks():
    from hotfix import status

    stock = run_stock(scenarios.EARLY_PROMOTION)
    assert stock.crash is None and stock.tracker.of_kind(COMPUTE_WHILE_LOADING)

    before = status.counters().get(FIX, {}).get("concurrent_load_held", 0)
    fixed, _ = run_fixed(scenarios.EARLY_PROMOTION, FIX)
    assert_clean(fixed)
    # the race, held on each rank: what /metrics shows as vllm:hotfix_concurrent_loads_held
    assert status.counters()[FIX]["concurrent_load_held"] == before + 2
    assert fixed.first_computed("R") is None  # still waiting for NIXL at the end (tick 4)
    assert {t.who for t in fixed.tracker.active_transfers if t.req_id == "R"} == {"nixl@rank0", "nixl@rank1"}


def test_reverse_ordering_nixl_first_waits_for_the_stray_lmcache_load():
    scenario = scenarios.NIXL_FIRST_LMCACHE_LATER
    stock = run_stock(scenario)
    assert stock.crash.source_line == IN_REQUESTS and stock.tracker.of_kind(COMPUTE_WHILE_LOADING)

    fixed, _ = run_fixed(scenario, FIX)
    assert_clean(fixed)
    assert delivered_at(fixed, "R") == [6] and fixed.first_computed("R") == 7


def test_both_loaders_in_the_same_step_are_forwarded_once():
    fixed, _ = run_fixed(scenarios.SAME_STEP_REPORTS, FIX)
    assert_clean(fixed)
    assert delivered_at(fixed, "R") == [3] == delivered_at(run_stock(scenarios.SAME_STEP_REPORTS), "R")


def test_reports_spread_over_ranks_and_steps_reach_the_aggregator_once_per_rank():
    stock = run_stock(scenarios.TP_MIXED_REPORTS)
    assert delivered_at(stock, "R") == [1, 6] and stock.crash.source_line == IN_REQUESTS

    fixed, _ = run_fixed(scenarios.TP_MIXED_REPORTS, FIX)
    assert_clean(fixed)
    assert delivered_at(fixed, "R") == [6]
    # what each rank's MultiConnector handed to KVOutputAggregator: R exactly once per rank
    forwarded = [rank for s in fixed.steps for rank in range(2) if "R" in s.forwarded.get(rank, ())]
    assert sorted(forwarded) == [0, 1]


def test_stray_report_after_promotion_is_absorbed_and_counted():
    from hotfix import status

    before = status.counters().get(FIX, {}).get("stray_report", 0)
    stock = run_stock(scenarios.STRAY_AFTER_PROMOTION)
    assert stock.crash is not None

    fixed, _ = run_fixed(scenarios.STRAY_AFTER_PROMOTION, FIX)
    assert_clean(fixed)
    assert delivered_at(fixed, "R") == [3]
    assert status.counters()[FIX]["stray_report"] == before + 1


def test_abort_while_both_load_frees_once_after_both_are_done():
    stock = run_stock(scenarios.ABORT_WHILE_BOTH_LOAD)
    assert stock.crash.source_line == IN_REQUESTS and stock.tracker.of_kind(WRITE_INTO_FREED)

    fixed, _ = run_fixed(scenarios.ABORT_WHILE_BOTH_LOAD, FIX)
    assert_clean(fixed)
    assert delivered_at(fixed, "R") == [5]


def test_nixl_keeps_heartbeating_while_it_still_pulls():
    """D5: NIXL's scheduler side is never told R finished before its own pull did."""
    stock = run_stock(scenarios.SIBLING_REPORT_ONLY)
    assert stock.world.child("nixl").heartbeat_stops == [(1, "R")]

    fixed, _ = run_fixed(scenarios.SIBLING_REPORT_ONLY, FIX)
    nixl = fixed.world.child("nixl")
    assert nixl.heartbeat_stops == [] and "R" in nixl.heartbeating()
    assert all("R" not in g.finished_recving for g in nixl.given_outputs)


def test_toggled_off_behaves_exactly_like_stock(monkeypatch):
    monkeypatch.setenv("HOTFIX_RECV_BARRIER", "off")
    for scenario in (scenarios.LATE_REPORT_AFTER_FREE, scenarios.EARLY_PROMOTION):
        fixed, states = run_fixed(scenario, FIX)
        assert states[FIX] == {"state": "skipped", "reason": "disabled", "wrapped": []}
        assert verdicts(fixed) == verdicts(run_stock(scenario))


@pytest.mark.skipif(not DEFERRED_LOADS_SUPPORTED, reason="deferred async loads are vLLM 0.33+")
@pytest.mark.parametrize("scenario", ["ABORT_AFTER_DEFERRED_LOAD_STARTED",
                                      "BUG_REPORT_ABORT_AFTER_DEFERRED_LOAD_STARTED"])
def test_abort_after_a_deferred_load_started_still_ships_the_plan_and_frees_once(scenario):
    """0.33: the load starts in update_from_output, the abort lands before the metadata is
    built. The plan must still travel (the READ runs), or the recv hold is never released."""
    scenario = getattr(scenarios, scenario)
    stock = run_stock(scenario)
    assert stock.crash.source_line == IN_REQUESTS

    fixed, _ = run_fixed(scenario, FIX, "xfer-guard")
    assert_clean(fixed)
    (delivered,) = delivered_at(fixed, "R")
    assert delivered >= nixl_done_at(fixed)
    assert "R" not in fixed.world.scheduler.requests


@pytest.mark.skipif(not FAILED_RECVS_SUPPORTED, reason="failed_recving is vLLM 0.30+")
@pytest.mark.parametrize("scenario, writer, finished_at", [
    ("NIXL_FAILS_WHILE_LMCACHE_WRITES", "lmc", 2),
    ("LMCACHE_FAILS_WHILE_NIXL_WRITES", "nixl", 5),
])
def test_failed_load_is_reported_once_after_the_other_loader_stops_writing(
        scenario, writer, finished_at):
    """L3: stock forwards one loader's failure at 2 and vLLM frees R's blocks under the other
    loader's write. Fixed, the failure reaches the scheduler once, with the other loader's
    completion at 5; R fails with an error either way. NIXL also marks its blocks invalid,
    which fails R at once (2), but R's recv hold keeps the blocks until the barrier opens."""
    scenario = getattr(scenarios, scenario)
    stock = run_stock(scenario)
    assert stock.crash.source_line == IN_REQUESTS and stock.crash.step == 5
    assert {(v.step, v.who) for v in stock.tracker.of_kind(WRITE_INTO_FREED)} == {(2, f"{writer}@rank0")}
    assert delivered_at(stock, "R", "failed") == [2]

    fixed, _ = run_fixed(scenario, FIX)
    assert_clean(fixed)
    assert delivered_at(fixed, "R") == delivered_at(fixed, "R", "failed") == [5]
    assert finished(fixed, "R") == (finished_at, "error")
    assert fixed.first_computed("R") is None


def test_late_first_episode_report_does_not_promote_the_load_after_preemption():
    """L4: without a local prefix cache the resumed R loads again under the same id. NIXL's
    late report of the first episode (6) promotes stock's second episode while LMCache still
    writes it, and LMCache's own report (9) then hits the running-request assert. Fixed, the
    report is absorbed as a stray and R runs only after the second load is done."""
    from hotfix import status

    scenario = scenarios.RESUME_LOAD_AFTER_PREEMPTION
    stock = run_stock(scenario)
    assert stock.step(4).status["R"] == "WAITING_FOR_REMOTE_KVS"  # a second load episode
    assert delivered_at(stock, "R") == [2, 6, 9] and stock.crash.source_line == IS_FINISHED
    assert {(v.step, v.who) for v in stock.tracker.of_kind(COMPUTE_WHILE_LOADING)} == {(7, "lmc@rank0")}

    before = status.counters().get(FIX, {}).get("stray_report", 0)
    fixed, _ = run_fixed(scenario, FIX)
    assert_clean(fixed)
    assert fixed.step(4).status["R"] == "WAITING_FOR_REMOTE_KVS"
    assert delivered_at(fixed, "R") == [2, 9]
    assert [s.step for s in fixed.steps if "R" in s.scheduled][:2] == [3, 10]
    assert finished(fixed, "R")[1] == "length"
    assert status.counters()[FIX]["stray_report"] == before + 1
