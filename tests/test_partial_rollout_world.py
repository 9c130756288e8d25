"""Partial rollout in the scheduler world (real Scheduler, MultiConnector, NIXL scheduler):
worker ranks the hotfix did not reach. A fix whose halves do not all answer the handshake
is exactly stock in that engine, with a `degraded` status; both were red before the halves'
handshake (pull-pin leaked the READ's blocks; recv-barrier barriered some ranks only)."""
from __future__ import annotations

from dataclasses import replace

from hotfix import status
from hotfix.worlds import scenarios
from hotfix.worlds.hotfix_on import hotfix_active
from hotfix.worlds.tracker import BLOCKS_NOT_RETURNED
from tests.worlds.verdicts import delivered_at, run_fixed, run_stock, verdicts


def run_degraded(scenario, fix: str):
    """Run with ``fix`` applied; also return its ``degraded`` reason (cleared at revert)."""
    with hotfix_active(fix) as act:
        states = act.snapshot()
        result = scenario.run()
        reason = status.degraded().get(fix, "")
    return result, states, reason


def free_blocks_per_step(result) -> list:
    return [(s.step, s.free_blocks) for s in result.steps]


def test_unpatched_workers_leave_nixl_exactly_stock_and_every_block_returns():
    """EngineCore patched, workers not: a healthy pull must return every block as stock does
    (the pin used to be released only by the worker half: 4 blocks leaked per READ)."""
    scenario = replace(scenarios.SINGLE_LOADER, unpatched_ranks=(0,))
    stock = run_stock(scenario)
    assert verdicts(stock) == (None, [])

    fixed, states, degraded = run_degraded(scenario, "pull-pin")
    assert states["pull-pin"]["state"] == "applied"
    assert fixed.tracker.of_kind(BLOCKS_NOT_RETURNED) == []
    assert verdicts(fixed) == verdicts(stock)
    # Exactly stock from the first output on: the provisional pin of tick 0 went back inside
    # that tick's update_from_output, so no snapshot ever saw a block held longer.
    assert free_blocks_per_step(fixed) == free_blocks_per_step(stock)
    assert fixed.world.scheduler.reset_prefix_cache()
    assert "worker half missing" in degraded


def test_one_unpatched_tp_rank_turns_the_load_barrier_off_on_every_rank():
    """TP=2, rank 1 not patched: barriering rank 0 alone is neither stock nor fixed (the
    aggregator mixes one rank's late report with the other's early ones)."""
    scenario = replace(scenarios.NIXL_RANKS_FINISH_APART, unpatched_ranks=(1,))
    stock = run_stock(scenario)
    assert stock.crash is not None and delivered_at(stock, "R")[0] == 1

    fixed, states, degraded = run_degraded(scenario, "recv-barrier")
    assert states["recv-barrier"]["state"] == "applied"
    assert verdicts(fixed) == verdicts(stock)
    assert delivered_at(fixed, "R") == delivered_at(stock, "R")
    assert "1 of 2 worker ranks" in degraded


def test_every_rank_patched_agrees_and_the_barrier_holds():
    fixed, _ = run_fixed(scenarios.NIXL_RANKS_FINISH_APART, "recv-barrier", "xfer-guard")
    assert fixed.crash is None, fixed.crash.traceback
    assert delivered_at(fixed, "R") == [12]
