"""pull-pin in the scheduler world (real NixlPullConnectorScheduler): the READ's blocks never
return to the pool before NIXL's own terminal report on every rank. Red on stock, asserted."""
from __future__ import annotations

from tests.worlds import scenarios
from tests.worlds.tracker import (BLOCKS_NOT_RETURNED, COMPUTE_WHILE_LOADING, WRITE_INTO_FREED,
                                  WRITE_INTO_REALLOCATED)
from tests.worlds.verdicts import finished, run_fixed, run_stock, verdicts

FIX = "pull-pin"
IN_REQUESTS = "assert req_id in self.requests"


def writes_into_foreign_blocks(result) -> list:
    return result.tracker.of_kind(WRITE_INTO_FREED) + result.tracker.of_kind(WRITE_INTO_REALLOCATED)


def test_read_blocks_stay_pinned_until_every_tp_rank_confirmed():
    scenario = scenarios.NIXL_RANKS_FINISH_APART
    stock = run_stock(scenario)
    assert writes_into_foreign_blocks(stock) and stock.crash.source_line == IN_REQUESTS

    fixed, states = run_fixed(scenario, FIX, "xfer-guard")
    assert states[FIX]["state"] == "applied"
    assert fixed.crash is None, fixed.crash.traceback
    assert writes_into_foreign_blocks(fixed) == []
    r_done = finished(fixed, "R")[0]
    assert r_done < 6  # R finished long before NIXL's READ did
    # The tracker saw NIXL write on rank 1 until 12 and never into a free or reused block;
    # rank 0's confirmation at 6 was not enough, rank 1's at 12 released the four READ blocks.
    read_blocks = {v.block for v in stock.tracker.of_kind(WRITE_INTO_FREED) if v.who == "nixl@rank1"}
    free = {s.step: s.free_blocks for s in fixed.steps}
    assert free[12] - free[11] == len(read_blocks) == 4
    assert fixed.tracker.of_kind(BLOCKS_NOT_RETURNED) == []


def test_abort_with_a_faster_save_no_longer_frees_under_the_read():
    scenario = scenarios.ABORT_SAVE_FIRST_ALL_SAVED
    stock = run_stock(scenario)
    assert stock.tracker.of_kind(WRITE_INTO_FREED)

    alone, _ = run_fixed(scenario, FIX)
    assert writes_into_foreign_blocks(alone) == []
    # honest boundary: the late report still trips the scheduler's assert; that is xfer-guard's
    assert alone.crash.source_line == IN_REQUESTS

    with_guard, _ = run_fixed(scenario, FIX, "xfer-guard")
    assert verdicts(with_guard) == (None, [])


def test_preempting_an_early_promoted_request_keeps_the_read_blocks_pinned():
    """Pitfall 13: preemption frees the request's blocks; the READ's targets stay out."""
    stock = run_stock(scenarios.PREEMPT_EARLY_PROMOTED)
    assert stock.tracker.of_kind(WRITE_INTO_FREED)

    fixed, _ = run_fixed(scenarios.PREEMPT_EARLY_PROMOTED, FIX)
    assert writes_into_foreign_blocks(fixed) == []
    assert fixed.tracker.of_kind(COMPUTE_WHILE_LOADING)  # early promotion is recv-barrier's


def test_all_three_fixes_together_leave_the_bug_report_scenario_clean():
    for scenario in (scenarios.LATE_REPORT_AFTER_FREE, scenarios.NIXL_RANKS_FINISH_APART):
        stock = run_stock(scenario)
        assert stock.crash is not None
        fixed, states = run_fixed(scenario, FIX, "xfer-guard", "recv-barrier")
        assert {s["state"] for s in states.values()} == {"applied"}
        assert verdicts(fixed) == (None, [])


def test_toggled_off_behaves_exactly_like_stock(monkeypatch):
    monkeypatch.setenv("HOTFIX_PULL_PIN", "off")
    fixed, states = run_fixed(scenarios.ABORT_SAVE_FIRST, FIX)
    assert states[FIX]["state"] == "skipped"
    assert verdicts(fixed) == verdicts(run_stock(scenarios.ABORT_SAVE_FIRST))
