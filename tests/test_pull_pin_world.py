"""pull-pin in the scheduler world (real NixlPullConnectorScheduler): the READ's blocks never
return to the pool before NIXL's own terminal report on every rank. Red on stock, asserted."""
from __future__ import annotations

from dataclasses import replace

from hotfix import status
from hotfix.worlds import scenarios
from hotfix.worlds.scheduler_world import buggy_lmcache_mp, nixl_pull
from hotfix.worlds.timeline import Arrive, LoadDone, StrayReport
from hotfix.worlds.tracker import (BLOCKS_NOT_RETURNED, COMPUTE_WHILE_LOADING, WRITE_INTO_FREED,
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


# Bidirectional KV transfer (NIXL's kv_connector_extra_config "bidirectional_kv_xfer"): a
# decode node keeps a normally finished request's blocks for P's turn-2 READ, so NIXL's
# request_finished returns True there (MultiConnector counts NIXL as an async save) and its
# worker reports R in finished_sending when P's READ is done or decoder_kv_blocks_ttl ran out.
# The world's NIXL worker does no send itself: that report is a StrayReport(kind="send").
BIDIRECTIONAL_NIXL = replace(nixl_pull(), extra_config=(("bidirectional_kv_xfer", True),))


def bidirectional(r: Arrive, *events) -> scenarios.Scenario:
    return scenarios.Scenario((BIDIRECTIONAL_NIXL, buggy_lmcache_mp()),
                              (Arrive(0, "B", max_tokens=24), r) + events)


def ref_counts(result) -> list:
    return [block.ref_cnt for block in result.world.scheduler.kv_cache_manager.block_pool.blocks]


def freed_at(result) -> dict:
    """Tick -> blocks that went back to the pool during it."""
    free = [s.free_blocks for s in result.steps]
    return {s.step: free[i] - free[i - 1] for i, s in enumerate(result.steps) if i and free[i] > free[i - 1]}


def pin_counts() -> tuple:
    counts = status.counters().get(FIX, {})
    return counts.get("pinned", 0), counts.get("released", 0)


def block_counts() -> tuple:
    counts = status.counters().get(FIX, {})
    return (counts.get("blocks_pinned", 0), counts.get("blocks_released", 0),
            status.gauges().get(FIX, {}).get("blocks_pinned_now", 0))


def test_bidirectional_clean_pull_pins_and_releases_without_changing_stocks_frees():
    """No race: R is promoted by NIXL's own report, finishes, and NIXL holds its blocks for
    the turn-2 READ until its send report. The pin goes at the READ's end, while R still
    holds the blocks: the pool sees exactly stock's frees, and every reference ends at 0."""
    scenario = bidirectional(Arrive(0, "R", remote_prefill=True, max_tokens=2),
                             LoadDone(2, "R", "nixl"), StrayReport(10, "R", "nixl", kind="send"))
    stock = run_stock(scenario)
    assert verdicts(stock) == (None, [])
    assert freed_at(stock)[10] == 5  # R's blocks, at NIXL's turn-2 report

    before, blocks_before = pin_counts(), block_counts()
    fixed, _ = run_fixed(scenario, FIX)
    assert pin_counts() == (before[0] + 1, before[1] + 1)
    # what /metrics sums: R's blocks the READ writes (all but its last) pinned and back
    assert [a - b for a, b in zip(block_counts(), blocks_before)] == [4, 4, 0]
    assert verdicts(fixed) == (None, [])
    assert freed_at(fixed) == freed_at(stock)
    assert ref_counts(fixed) == ref_counts(stock) and set(ref_counts(fixed)) == {0}


def test_bidirectional_turn2_report_under_a_running_read_keeps_its_blocks_pinned():
    """R, promoted early by the cache, finishes at 3; NIXL's turn-2 hold ends (P's READ, or
    its TTL) at 6 while NIXL's own READ into R's blocks runs until 10. Stock frees them at 6
    under the READ, then NIXL's report for the freed R kills the EngineCore. With pull-pin
    the READ's four blocks go back once, at 10 (R's fifth block, never read into, at 6)."""
    scenario = bidirectional(scenarios.REMOTE_R, LoadDone(1, "R", "lmc"), LoadDone(10, "R", "nixl"),
                             StrayReport(6, "R", "nixl", kind="send"))
    stock = run_stock(scenario)
    assert {v.step for v in stock.tracker.of_kind(WRITE_INTO_FREED)} == {6}
    assert stock.crash.source_line == IN_REQUESTS
    assert stock.crash.enclosing_loop() == "for req_id in kv_connector_output.finished_recving or ():"

    fixed, _ = run_fixed(scenario, FIX, "xfer-guard")
    assert fixed.crash is None, fixed.crash.traceback
    assert writes_into_foreign_blocks(fixed) == []
    assert fixed.tracker.of_kind(BLOCKS_NOT_RETURNED) == []
    freed = freed_at(fixed)
    assert (freed[6], freed[10]) == (1, 4)
    assert set(ref_counts(fixed)) == {0}


def test_bidirectional_read_ending_first_leaves_one_release_to_nixls_turn2_report():
    """The other order: the READ ends at 6, NIXL's turn-2 hold at 10. Stock's recv loop frees
    R's blocks at 6 although NIXL still offers them to P, then its send report asserts.
    pull-pin alone changes nothing there (its pin goes at 6, R still holds the blocks);
    with xfer-guard's hold ledger the blocks go back once, at 10, every reference at 0."""
    scenario = bidirectional(scenarios.REMOTE_R, LoadDone(1, "R", "lmc"), LoadDone(6, "R", "nixl"),
                             StrayReport(10, "R", "nixl", kind="send"))
    stock = run_stock(scenario)
    assert freed_at(stock)[6] == 5
    assert stock.crash.source_line == IN_REQUESTS
    assert stock.crash.enclosing_loop() == "for req_id in kv_connector_output.finished_sending or ():"

    alone, _ = run_fixed(scenario, FIX)
    assert verdicts(alone) == verdicts(stock) and freed_at(alone) == freed_at(stock)

    fixed, _ = run_fixed(scenario, FIX, "xfer-guard")
    assert fixed.crash is None, fixed.crash.traceback
    assert writes_into_foreign_blocks(fixed) == []
    assert fixed.tracker.of_kind(BLOCKS_NOT_RETURNED) == []
    assert 6 not in freed_at(fixed) and freed_at(fixed)[10] == 5
    assert set(ref_counts(fixed)) == {0}
