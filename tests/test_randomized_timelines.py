"""Randomized timelines in the scheduler world: hypothesis finds a failure on stock vLLM
(red), and with recv-barrier and xfer-guard on it finds none in a CI-sized budget (green).

The property (`tests.worlds.randomized.play`): no crash, no tracker violation (writes or
reads into freed or reallocated blocks, compute over blocks still loading, blocks not
returned), and no request left behind although every transfer in the timeline completed.
`benchmarks/timelines.py` runs the same property over 10,000+ timelines.
"""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, find, given, settings

from hotfix.worlds.hotfix_on import hotfix_active
from tests.worlds.randomized import NEVER_FINISHED, play, timelines
from hotfix.worlds.scenarios import BUG_REPORT, NIXL_AND_SAVING_CACHE, Scenario
from hotfix.worlds.scheduler_world import patched_methods
from hotfix.worlds.timeline import Arrive, LoadDone, Preempt, SaveDone

FIXES = ("recv-barrier", "xfer-guard", "pull-pin")
QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]
STOCK_SEARCH = settings(max_examples=60, derandomize=True, database=None, deadline=None,
                        suppress_health_check=QUIET)
FIXED_BUDGET = settings(max_examples=200, derandomize=True, database=None, deadline=None,
                        suppress_health_check=QUIET)


def test_stock_vllm_fails_a_random_timeline_hypothesis_finds_and_shrinks():
    """Red first: the property has teeth; unmodified vLLM breaks it on a small timeline."""
    assert patched_methods() == []
    failing = find(timelines(), lambda scenario: bool(play(scenario).problems()),
                   settings=STOCK_SEARCH)
    outcome = play(failing)
    assert outcome.problems(), outcome.report()
    assert NEVER_FINISHED not in outcome.problems()  # a stock failure, not a timeline that hangs
    assert len(failing.timeline) <= 6, outcome.report()


def test_fixed_vllm_keeps_every_invariant_on_random_timelines():
    """Green: with both fixes on, no generated interleaving crashes, corrupts or leaks."""
    seen: Counter = Counter()

    @FIXED_BUDGET
    @given(timelines())
    def keeps_invariants(scenario):
        outcome = play(scenario)
        assert outcome.problems() == [], outcome.report()
        seen.update(outcome.features())

    with hotfix_active(*FIXES) as act:
        assert {fix: state["state"] for fix, state in act.snapshot().items()} == dict.fromkeys(
            FIXES, "applied")
        keeps_invariants()
    # the budget really reached the races: reuse, preemption, aborts, saves, TP, async
    assert set(seen) == {"tp2", "async_scheduling", "id_reuse", "preemption", "abort",
                         "async_save", "per_rank_completion"}, seen


def test_preempting_a_request_that_is_not_running_is_skipped_not_a_crash():
    """A generated Preempt cannot know whether R still waits for its KV; only running
    requests are evicted, the rest are recorded as skipped."""
    outcome = play(Scenario(BUG_REPORT, (
        Arrive(0, "B", max_tokens=8),
        Arrive(0, "R", remote_prefill=True, max_tokens=2),
        Preempt(1, "R"),  # still WAITING_FOR_REMOTE_KVS
        LoadDone(3, "R", "nixl"),
        Preempt(5, "B"),  # running
        Preempt(12, "R"),  # long finished
    )))
    assert outcome.problems() == []
    assert [(p.step, p.req) for p in outcome.skipped] == [(1, "R"), (12, "R")]
    assert [(p.step, p.req) for p in outcome.preempted] == [(5, "B")]


def test_reused_id_arrives_only_after_the_engine_let_the_old_request_go():
    """vLLM asserts on a duplicate live id, and an async batch still carrying the old id
    would hand its token to the new request: the second R waits for both to be over."""
    for async_scheduling in (False, True):
        outcome = play(Scenario(NIXL_AND_SAVING_CACHE, (
            Arrive(0, "R", max_tokens=2),
            Arrive(0, "R", max_tokens=2),
            SaveDone(6, "R", "lmc"),  # the first R's save holds its blocks until 6
            SaveDone(6, "R", "lmc"),
        ), async_scheduling=async_scheduling))
        assert outcome.problems() == [], outcome.report()
        ((step, req),) = outcome.reused
        assert req == "R" and step > 6


def test_a_load_that_never_completes_is_reported_as_never_finished():
    """The liveness half of the property: a request stuck waiting for its KV is caught
    (the generator completes every load, so on a real run this is the engine's fault)."""
    outcome = play(Scenario(BUG_REPORT, (Arrive(0, "R", remote_prefill=True),), grace=6))
    assert outcome.problems() == [NEVER_FINISHED]
    assert outcome.never_finished == ["R"]

