"""pull-pin hardening in the scheduler world (real Scheduler, MultiConnector, NIXL scheduler):
pipeline stages, a hybrid model's two KV-cache groups, a reused request id and an engine that goes idle under a READ. Each scenario's stock run is
asserted first; each was red on the pull-pin before (a stage still writing into released
blocks, blocks never returned)."""
from __future__ import annotations

from dataclasses import replace

from hotfix.worlds import scenarios
from hotfix.worlds.tracker import BLOCKS_NOT_RETURNED, WRITE_INTO_FREED, WRITE_INTO_REALLOCATED
from tests.worlds.verdicts import delivered_at, finished, run_fixed, run_stock

FIX = "pull-pin"


def writes_into_foreign_blocks(result) -> list:
    return result.tracker.of_kind(WRITE_INTO_FREED) + result.tracker.of_kind(WRITE_INTO_REALLOCATED)


def test_a_pin_waits_for_every_pipeline_stage_not_only_the_tp_ranks():
    """PP=2: each stage's NIXL reads its own layers; KVOutputAggregator counts world_size."""
    stock = run_stock(scenarios.NIXL_STAGES_FINISH_APART)
    late_stage = {v.block for v in writes_into_foreign_blocks(stock) if v.who == "nixl@rank1"}
    assert late_stage, "stage 1's READ must outlive R's blocks on stock"

    fixed, _ = run_fixed(scenarios.NIXL_STAGES_FINISH_APART, FIX, "xfer-guard")
    assert fixed.crash is None, fixed.crash.traceback
    assert writes_into_foreign_blocks(fixed) == []
    free = {s.step: s.free_blocks for s in fixed.steps}
    heard = delivered_at(fixed, "R")[-1]  # stage 1's report of 12 (PP: two batches in flight)
    assert heard >= 12 and all(free[t] <= free[heard - 1] for t in range(6, heard))
    assert free[heard] - free[heard - 1] == len(late_stage), "released by the last stage only"
    assert fixed.tracker.of_kind(BLOCKS_NOT_RETURNED) == []


def test_an_idle_engine_keeps_stepping_until_nixl_confirms_then_stops():
    """R finished under NIXL's READ and nothing else arrives: the pin must not wait for
    traffic (reset_prefix_cache, used by RLHF weight sync, fails while a block is held)."""
    scenario = scenarios.NIXL_LATE_ON_AN_IDLE_ENGINE
    stock = run_stock(scenario)
    assert stock.tracker.of_kind(WRITE_INTO_FREED)
    assert delivered_at(stock, "R") == [1], "stock goes idle: NIXL's report is never heard"

    fixed, _ = run_fixed(scenario, FIX, "xfer-guard")
    assert fixed.crash is None, fixed.crash.traceback
    assert writes_into_foreign_blocks(fixed) == []
    assert 9 in delivered_at(fixed, "R"), "the engine kept stepping while the READ ran"
    assert fixed.tracker.of_kind(BLOCKS_NOT_RETURNED) == []
    assert fixed.world.scheduler.reset_prefix_cache()
    assert not fixed.world.scheduler.has_requests()
    assert fixed.steps[-1].step <= 10, "it stops within one step of the release"


def test_a_hybrid_models_read_is_pinned_in_both_kv_cache_groups():
    """Full-attention and sliding-window layers (vLLM's hybrid allocator: two KV-cache groups,
    one pool): NIXL READs both groups, the window's clipped to its last blocks. Every target
    of both groups stays pinned until the last rank's report, then all return."""
    scenario = replace(scenarios.NIXL_RANKS_FINISH_APART, sliding_window=16)
    stock = run_stock(scenario)
    assert len(stock.world.kv_cache_config.kv_cache_groups) == 2
    late = {v.block for v in writes_into_foreign_blocks(stock) if v.who == "nixl@rank1"}
    assert len(late) == 3 + 2, "48 tokens: 3 full-attention blocks and the window's 2"

    fixed, _ = run_fixed(scenario, FIX, "xfer-guard")
    assert fixed.crash is None, fixed.crash.traceback
    assert writes_into_foreign_blocks(fixed) == []
    free = {s.step: s.free_blocks for s in fixed.steps}
    assert free[12] - free[11] == len(late), "both groups' targets released at rank 1's report"
    assert fixed.tracker.of_kind(BLOCKS_NOT_RETURNED) == []
    assert fixed.world.scheduler.reset_prefix_cache()


def test_two_reads_under_one_request_id_are_each_pinned_and_both_released():
    """R finishes under its READ, arrives again under the same id and finishes under its second
    READ; NIXL's one report for the id covers both. Each READ's targets stay pinned until it."""
    scenario = scenarios.READS_UNDER_ONE_REQUEST_ID
    stock = run_stock(scenario)
    written_after_free = {v.step for v in stock.tracker.of_kind(WRITE_INTO_FREED)}
    assert written_after_free == {3, 9}, "each R's READ outlives that R's blocks on stock"
    assert stock.crash.source_line == "assert req_id in self.requests"

    fixed, _ = run_fixed(scenario, FIX, "xfer-guard")
    assert fixed.crash is None, fixed.crash.traceback
    assert writes_into_foreign_blocks(fixed) == []
    assert [finished(fixed, "R")[0], delivered_at(fixed, "R")] == [3, [1, 7, 12]]
    free = {s.step: s.free_blocks for s in fixed.steps}
    assert free[12] - free[11] == 4 + 4, "one report, both READs' targets back"
    assert fixed.tracker.of_kind(BLOCKS_NOT_RETURNED) == []
    assert fixed.world.scheduler.reset_prefix_cache()
