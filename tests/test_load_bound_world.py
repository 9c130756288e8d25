"""load-bound (D8) in the scheduler world: a load past HOTFIX_LOAD_TIMEOUT_S ends its request
through vLLM's failed-load path within the bound; its blocks stay quarantined until the late
report. Each scenario is red on stock or on today's main (recv-barrier alone wedges the stray
case), asserted."""
from __future__ import annotations

from dataclasses import replace

import pytest

from hotfix import status
from hotfix.worlds import scenarios
from hotfix.fixes import load_bound
from hotfix.worlds.scheduler_world import DEFERRED_LOADS_SUPPORTED, INFLIGHT_LIMIT_SUPPORTED
from hotfix.worlds.timeline import Arrive, LoadDone
from hotfix.worlds.tracker import COMPUTE_WHILE_LOADING
from tests.worlds.verdicts import finished, run_fixed, run_stock, verdicts

FIX = "load-bound"
LATE = 9  # the late report's tick in every scenario here


@pytest.fixture(autouse=True)
def short_bound(monkeypatch):
    monkeypatch.setenv("HOTFIX_LOAD_TIMEOUT_S", str(scenarios.LOAD_BOUND_TEST_S))


def counter(kind: str) -> int:
    return status.counters().get(FIX, {}).get(kind, 0)


def waiting_until_the_late_report(result, req_id="R") -> bool:
    """``req_id`` sat in WAITING_FOR_REMOTE_KVS from tick 1 to the tick before the late report:
    the bound passed (tick 2) and nothing ended it."""
    return all(result.step(t).status.get(req_id) == "WAITING_FOR_REMOTE_KVS" for t in range(1, LATE))


def assert_bounded(fixed, stock, policy):
    """Terminal within the bound (tick 2: the first step past it), no write into a freed or
    reused block and no compute over a running load (the tracker), quarantined blocks out of
    the pool until the late report and every block back after it, the bystander untouched."""
    assert fixed.crash is None, fixed.crash.traceback
    assert fixed.violations == []  # includes the end-of-run check: every block returned
    assert fixed.world.scheduler.reset_prefix_cache()
    if policy == "fail":
        assert finished(fixed, "R") == (2, "error") and fixed.first_computed("R") is None
    else:  # computed again at once, in blocks no transfer writes
        assert fixed.first_computed("R") == 3 and finished(fixed, "R")[1] == "length"
    quarantined = fixed.step(LATE).free_blocks - fixed.step(LATE - 1).free_blocks
    assert quarantined > 0  # they came back with the late report, not before
    assert finished(fixed, "B") == finished(stock, "B") == (15, "length")


ALL = ("recv-barrier", "xfer-guard", "pull-pin", "lease-guard", "nixl-settle")


def run_bounded(scenario, *fixes):
    """The scenario with load-bound and ``fixes``, and what it counted."""
    before = counter("timed_out_nixl"), counter("late_report")
    fixed, states = run_fixed(scenario, FIX, *fixes)
    assert states[FIX]["state"] == "applied"
    assert (counter("timed_out_nixl"), counter("late_report")) == (before[0] + 1, before[1] + 1)
    assert status.gauges()[FIX]["blocks_quarantined_now"] == 0
    return fixed


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_stray_load_that_never_ends_no_longer_wedges_the_request(policy):
    """recv-barrier waits for the stray LMCache retrieve too: today's main leaves R waiting
    until it ends (stock computes R over it instead). With recompute the retry is LMCache's
    own load again (its hit), which passes the bound too: then R ends with an error."""
    scenario = replace(scenarios.STRAY_LOAD_PAST_THE_BOUND, kv_load_failure_policy=policy)
    stock = run_stock(scenario)
    assert COMPUTE_WHILE_LOADING in stock.tracker.kinds()
    main, _ = run_fixed(scenario, *ALL)
    assert waiting_until_the_late_report(main)

    if policy == "recompute":
        scenario = replace(scenario, timeline=scenario.timeline + (scenarios.Elapse(4, 1.5 * scenarios.LOAD_BOUND_TEST_S),))
    fixed = run_bounded(scenario, *ALL)
    assert fixed.violations == [] and fixed.world.scheduler.reset_prefix_cache()
    assert fixed.first_computed("R") is None
    assert finished(fixed, "R") == ((2, "error") if policy == "fail" else (4, "error"))
    assert finished(fixed, "B") == finished(main, "B") == (15, "length")


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("fixes", [(), ALL], ids=["alone", "with-every-fix"])
@pytest.mark.parametrize("name", ["CHOSEN_LOAD_PAST_THE_BOUND", "RANK_LOAD_PAST_THE_BOUND"])
def test_chosen_or_one_ranks_read_that_never_ends_reaches_a_terminal_state(name, fixes, policy):
    """Stock (and today's main) leave R waiting for the READ, one rank's included; bounded, the
    policy decides at the first step past the bound."""
    scenario = replace(getattr(scenarios, name), kv_load_failure_policy=policy)
    stock = run_stock(scenario)
    assert waiting_until_the_late_report(stock)
    assert_bounded(run_bounded(scenario, *fixes), stock, policy)


def test_loads_within_the_bound_behave_exactly_as_without_it():
    scenario = scenarios.LOADS_WITHIN_THE_BOUND
    before = status.counters().get(FIX, {})
    without, _ = run_fixed(scenario, *ALL)
    fixed, _ = run_fixed(scenario, FIX, *ALL)
    assert verdicts(fixed) == verdicts(without) and fixed.violations == []
    assert [(s.scheduled, s.status, s.finished) for s in fixed.steps] == \
        [(s.scheduled, s.status, s.finished) for s in without.steps]
    assert status.counters().get(FIX, {}) == before


@pytest.mark.parametrize("value", ["0", "off"])
def test_bound_switched_off_waits_like_stock(monkeypatch, value):
    monkeypatch.setenv("HOTFIX_LOAD_TIMEOUT_S", value)
    fixed, _ = run_fixed(scenarios.CHOSEN_LOAD_PAST_THE_BOUND, FIX)
    assert waiting_until_the_late_report(fixed)
    assert verdicts(fixed) == verdicts(run_stock(scenarios.CHOSEN_LOAD_PAST_THE_BOUND))


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_async_scheduler_ends_a_hung_read_at_the_bound_too(policy):
    """With the batch queue the output of a step is processed one step later; the bound
    still ends R at the first step past it, and the late report still returns its blocks."""
    scenario = replace(scenarios.CHOSEN_LOAD_PAST_THE_BOUND, kv_load_failure_policy=policy,
                       async_scheduling=True)
    assert waiting_until_the_late_report(run_stock(scenario))
    fixed = run_bounded(scenario, *ALL)
    assert fixed.crash is None and fixed.violations == []
    assert fixed.world.scheduler.reset_prefix_cache()
    if policy == "fail":
        assert finished(fixed, "R") == (2, "error")
    else:
        assert fixed.first_computed("R") == 3 and finished(fixed, "R")[1] == "length"


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_hybrid_kv_cache_read_that_never_ends_is_never_decoded_over(policy):
    """Two KV-cache groups (full + sliding window). 0.30+: failed_recving carries the failure,
    so the policy decides as for one group. 0.27-0.29 map invalid blocks of one group only
    (vLLM's own "TODO ... hybrid"): the request ends with an error whatever the policy."""
    from hotfix.worlds.scheduler_world import FAILED_RECVS_SUPPORTED

    scenario = replace(scenarios.CHOSEN_LOAD_PAST_THE_BOUND, kv_load_failure_policy=policy,
                       sliding_window=32)
    assert waiting_until_the_late_report(run_stock(scenario))
    fixed = run_bounded(scenario, *ALL)
    assert fixed.crash is None and fixed.violations == []
    assert fixed.world.scheduler.reset_prefix_cache()
    if policy == "recompute" and FAILED_RECVS_SUPPORTED:
        assert fixed.first_computed("R") == 3 and finished(fixed, "R")[1] == "length"
    else:
        assert finished(fixed, "R") == (2, "error") and fixed.first_computed("R") is None


def test_request_aborted_while_its_read_hangs_is_counted_and_left_to_vllms_own_hold():
    """No client waits and vLLM itself keeps the blocks until NIXL reports (its recv hold):
    the bound counts it and changes nothing, the late report frees them as on stock."""
    scenario = scenarios.ABORT_WHILE_READ_PAST_THE_BOUND
    stock = run_stock(scenario)
    assert stock.violations == [] and stock.step(8).free_blocks < stock.step(9).free_blocks
    before = counter("timed_out_nixl"), counter("late_report")
    fixed, _ = run_fixed(scenario, FIX, *ALL)
    assert verdicts(fixed) == verdicts(stock) and fixed.violations == []
    assert [s.free_blocks for s in fixed.steps] == [s.free_blocks for s in stock.steps]
    assert (counter("timed_out_nixl"), counter("late_report")) == (before[0] + 1, before[1])


@pytest.mark.skipif(not INFLIGHT_LIMIT_SUPPORTED, reason="no --max-num-inflight-kv-loads before vLLM 0.34")
def test_an_aborted_read_that_hangs_no_longer_holds_the_only_inflight_load_slot():
    """vLLM 0.34, one in-flight KV load at most: R is aborted while its READ hangs, and vLLM
    counts that load in flight until it reports. Stock: S's async load waits for the slot
    until R's late report (a hung transfer stalls every later load); with the bound, R's slot
    is given back once past it (its blocks stay vLLM's until the report): S runs at once."""
    scenario = scenarios.ABORT_WHILE_READ_PAST_THE_BOUND_THEN_S
    stock = run_stock(scenario)
    assert stock.violations == []
    assert all(stock.step(t).status.get("S") == "WAITING" for t in range(3, LATE + 1))  # the red

    fixed, _ = run_fixed(scenario, FIX, *ALL)
    assert fixed.crash is None, fixed.crash.traceback
    assert fixed.violations == [] and fixed.world.scheduler._aborted_kv_loads == set()
    assert fixed.first_computed("S") < LATE and finished(fixed, "S")[1] == "length"
    assert fixed.step(LATE).free_blocks > fixed.step(LATE - 1).free_blocks  # R's, at its report


@pytest.mark.skipif(not DEFERRED_LOADS_SUPPORTED, reason="deferred async loads are vLLM 0.33+")
def test_a_parked_load_starts_its_clock_only_once_vllm_starts_the_load(monkeypatch):
    """vLLM 0.33+ parks an async load scheduled while a batch is in flight (``deferred_loads``,
    status already WAITING_FOR_REMOTE_KVS) and starts it when that batch is processed: the
    clock must not count the parked time, so it starts at the step after the load started."""
    seen = []  # per step: (R parked when the clock's scan ran, R's clock running after it)

    def spy(scheduler, state, now, reported):
        parked = "R" in scheduler.deferred_loads
        load_bound._start_the_clock_of_new_loads.__wrapped__(scheduler, state, now, reported)
        seen.append((parked, "R" in state.clock))

    spy.__wrapped__ = load_bound._start_the_clock_of_new_loads
    monkeypatch.setattr(load_bound, "_start_the_clock_of_new_loads", spy)
    scenario = scenarios.Scenario(
        (scenarios.nixl_pull(),), (scenarios.BYSTANDER, Arrive(1, "R", remote_prefill=True, max_tokens=2),
                                   LoadDone(4, "R", "nixl")),
        async_scheduling=True, defer_async_loads=True)
    fixed, _ = run_fixed(scenario, FIX)
    assert fixed.crash is None and fixed.violations == []
    assert (True, False) in seen and (True, True) not in seen  # parked: no clock yet
    assert (False, True) in seen and finished(fixed, "R")[1] == "length"  # then bounded
