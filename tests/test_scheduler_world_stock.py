"""Unmodified vLLM in the scheduler world: every race of vllm-targets.md §0.2
ends in its exact failure, and the orderings production survives stay clean.
The fix tests replay the same scenarios with the hotfix active."""

from dataclasses import replace

import pytest

from hotfix.worlds import scenarios
from hotfix.worlds.scheduler_world import DEFERRED_LOADS_SUPPORTED, patched_methods
from hotfix.worlds.tracker import (
    BLOCKS_NOT_RETURNED,
    COMPUTE_WHILE_LOADING,
    READ_FROM_FREED,
    WRITE_INTO_FREED,
)

IN_REQUESTS = "assert req_id in self.requests"
IS_FINISHED = "assert RequestStatus.is_finished(req.status)"


@pytest.fixture(autouse=True)
def stock_vllm():
    """These tests are about unmodified vLLM; a hotfix activated earlier in
    this process would turn every red result green."""
    assert patched_methods() == [], "vLLM is patched in this process"


def assert_engine_core_dies(result, line: str, loop: str) -> None:
    crash = result.crash
    assert crash is not None, "stock vLLM was expected to kill EngineCore"
    assert isinstance(crash.exc, AssertionError), crash.traceback
    assert crash.phase == "update_from_output"
    assert crash.function == "_update_from_kv_xfer_finished"
    assert crash.source_line == line
    assert loop in crash.enclosing_loop()


def blocks_flagged(result, kind: str, who: str, req_id: str = "R") -> set[int]:
    return {
        v.block for v in result.tracker.of_kind(kind) if v.who == who and v.req_id == req_id
    }


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_stock_late_nixl_report_after_free_kills_engine(async_scheduling):
    """The seed traceback: LMCache's load promotes R, R finishes and is freed,
    NIXL's pull completes later — having written into freed blocks (D3)."""
    scenario = replace(scenarios.LATE_REPORT_AFTER_FREE, async_scheduling=async_scheduling)
    result = scenario.run()

    assert_engine_core_dies(result, IN_REQUESTS, "finished_recving")
    assert type(result.world.scheduler).__name__ == (
        "AsyncScheduler" if async_scheduling else "Scheduler"
    )
    assert result.step(8).reported("nixl", "R") == [0]
    finished_at = next(s.step for s in result.steps if "R" in s.finished)
    assert finished_at < 8
    assert len(blocks_flagged(result, WRITE_INTO_FREED, "nixl@rank0")) == 4


def test_stock_late_nixl_report_while_running_kills_engine():
    """R, promoted early by LMCache, is still decoding when NIXL reports."""
    result = scenarios.LATE_REPORT_WHILE_RUNNING.run()

    assert_engine_core_dies(result, IS_FINISHED, "finished_recving")
    assert result.crash.step == 4
    assert result.step(3).status["R"] == "RUNNING"


def test_stock_sibling_load_promotes_request_while_nixl_still_writes():
    """D1: the union of finished_recving lets the buggy LMCache load promote
    R; R and a prefix-cache sharer S compute over blocks NIXL has not written
    yet — silent wrong output, no crash (yet)."""
    result = scenarios.EARLY_PROMOTION.run()

    assert result.crash is None
    # NIXL (listed first, whole prompt) was chosen; LMCache loaded anyway.
    assert result.step(1).reported("lmc", "R") == [0, 1]
    assert result.step(1).reported("nixl", "R") == []
    assert result.step(1).delivered_recving == {"R"}
    assert result.first_computed("R") == 2
    pulls = {t.who: t.blocks for t in result.tracker.active_transfers if t.req_id == "R"}
    assert set(pulls) == {"nixl@rank0", "nixl@rank1"}
    for who, blocks in pulls.items():
        assert blocks_flagged(result, COMPUTE_WHILE_LOADING, who) == blocks
    shared = blocks_flagged(result, COMPUTE_WHILE_LOADING, "nixl@rank0", req_id="S")
    assert shared and shared < pulls["nixl@rank0"]


def test_stock_mixed_tp_reports_promote_early_then_second_report_kills_engine():
    """KVOutputAggregator counts reports per request, not per connector: one
    LMCache and one NIXL report make "all ranks done"; the other two later
    make a second finished_recving for the freed R."""
    result = scenarios.TP_MIXED_REPORTS.run()

    assert result.step(1).delivered_recving == {"R"}
    assert result.first_computed("R") == 2
    assert blocks_flagged(result, COMPUTE_WHILE_LOADING, "nixl@rank0")
    assert blocks_flagged(result, COMPUTE_WHILE_LOADING, "lmc@rank1")
    assert_engine_core_dies(result, IN_REQUESTS, "finished_recving")
    assert result.crash.step == 6


def test_stock_abort_during_remote_load_save_first_frees_under_nixl_read():
    """D4 with a well-behaved LMCache: the abort's recv hold and LMCache's
    save hold count as one, the save's completion frees R under the READ,
    and NIXL's completion hits the recv-loop assert (the seed traceback)."""
    result = scenarios.ABORT_SAVE_FIRST.run()

    assert result.step(1).status["R"] == "FINISHED_ABORTED"
    assert "R" not in result.step(2).status
    assert {v.step for v in result.tracker.of_kind(WRITE_INTO_FREED)} == {2}
    assert len(blocks_flagged(result, WRITE_INTO_FREED, "nixl@rank0")) == 4
    assert_engine_core_dies(result, IN_REQUESTS, "finished_recving")
    assert result.crash.step == 4


def test_stock_abort_during_remote_load_nixl_first_frees_under_async_save():
    """D4 the other way round: NIXL's completion takes the designed release
    path and frees R while LMCache still saves it; the save's completion then
    hits the send-loop assert."""
    result = scenarios.ABORT_NIXL_FIRST.run()

    assert result.tracker.of_kind(WRITE_INTO_FREED) == []
    assert len(blocks_flagged(result, READ_FROM_FREED, "lmc@rank0")) == 4
    assert_engine_core_dies(result, IN_REQUESTS, "finished_sending")
    assert result.crash.step == 4


@pytest.mark.skipif(not DEFERRED_LOADS_SUPPORTED, reason="deferred async loads are vLLM 0.33+")
def test_stock_abort_after_deferred_load_started_frees_under_nixl_read():
    """vLLM 0.33 deferred async loads (pitfall 10): schedule() parks R's load at 1 and
    _drain_deferred_loads starts it when the in-flight batch is processed; the abort at 2
    comes before the metadata with NIXL's READ is built. finish_requests keeps the recv
    hold, the READ starts anyway, LMCache's save completion frees R under it (D4) and
    NIXL's completion hits the recv-loop assert."""
    result = scenarios.ABORT_AFTER_DEFERRED_LOAD_STARTED.run()

    assert result.step(1).deferred_loads == {"R"}
    assert result.step(2).deferred_loads == set()
    assert result.step(2).status["R"] == "FINISHED_ABORTED"
    # the save's report (tick 3) is processed one batch later, as with the batch queue
    assert {v.step for v in result.tracker.of_kind(WRITE_INTO_FREED)} == {4}
    assert len(blocks_flagged(result, WRITE_INTO_FREED, "nixl@rank0")) == 4
    assert_engine_core_dies(result, IN_REQUESTS, "finished_recving")
    assert result.step(5).reported("nixl", "R") == [0]


def test_stock_sibling_report_stops_nixl_heartbeat():
    """D5: MultiConnector hands NIXL the merged finished_recving, so NIXL ends
    R's lease heartbeat when only LMCache has finished."""
    result = scenarios.SIBLING_REPORT_ONLY.run()
    nixl = result.world.child("nixl")

    assert result.crash is None
    assert result.step(1).reported("lmc", "R") == [0]
    assert result.step(1).reported("nixl", "R") == []
    assert [g.finished_recving for g in nixl.given_outputs if g.step == 1] == [{"R"}]
    assert nixl.heartbeat_stops == [(1, "R")]
    assert "R" not in nixl.heartbeating()
    still_pulling = [t.who for t in result.tracker.active_transfers if t.req_id == "R"]
    assert still_pulling == ["nixl@rank0"]


def test_stock_preempting_early_promoted_request_frees_blocks_under_nixl():
    """Pitfall 13: preempting the early-promoted R returns its blocks to the
    pool while NIXL is still writing them."""
    result = scenarios.PREEMPT_EARLY_PROMOTED.run()

    assert result.crash is None
    assert {v.step for v in result.tracker.of_kind(WRITE_INTO_FREED)} == {3}
    assert len(blocks_flagged(result, WRITE_INTO_FREED, "nixl@rank0")) == 4


@pytest.mark.parametrize(
    ("tp", "async_scheduling"), [(1, False), (2, True)], ids=["tp1-sync", "tp2-async"]
)
def test_stock_single_loader_completes_cleanly(tp, async_scheduling):
    """Control: without a second load (no LMCache hit) stock vLLM is fine and
    every block comes back."""
    scenario = replace(scenarios.SINGLE_LOADER, tp=tp, async_scheduling=async_scheduling)
    result = scenario.run()

    assert result.crash is None, result.crash.traceback
    assert result.violations == []
    assert result.first_computed("R") > 3
    assert any(s.finished.get("R") == "length" for s in result.steps)


def test_stock_both_loaders_reporting_in_the_same_step_complete_cleanly():
    """Control: the double load is harmless when both finish together — the
    short-context case the bug report says existing tests cover."""
    result = scenarios.SAME_STEP_REPORTS.run()

    assert result.crash is None, result.crash.traceback
    assert result.violations == []
    assert result.step(3).delivered_recving == {"R"}
    assert result.first_computed("R") == 4


def test_world_flags_blocks_held_by_a_save_that_never_reports():
    """The pool check at the end of a run catches a hold nobody releases."""
    result = scenarios.SAVE_NEVER_REPORTS.run()

    assert result.crash is None
    (leak,) = result.tracker.of_kind(BLOCKS_NOT_RETURNED)
    # 64 prompt tokens and one decoded position: five blocks, all R's.
    assert leak.detail == (
        "5 of 63 blocks not returned; last known holders: "
        "{1: ['R'], 2: ['R'], 3: ['R'], 4: ['R'], 5: ['R']}"
    )
