"""The failed-load path our fixes route into (issue #27), in the scheduler world, every release.

D11 (reported on a 0.27 fork: "a recompute after a failed load does not wake an idle engine;
the request waits until the next request arrives") does not reproduce on stock vLLM: the
world stops ticking as soon as ``Scheduler.has_requests()`` is False (what lets the real
EngineCore block on its input queue), and a lone request whose NIXL READ failed is still
recomputed and finished without any other traffic, stock and with every fix on. vLLM counts
``skipped_waiting`` (where the failed request waits) in ``get_num_unfinished_requests``.

D10 (vLLM #49250) concerns synchronous loads; the test below shows why the asynchronous loads
our fixes fail are not exposed to it.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from hotfix.worlds.scenarios import Scenario
from hotfix.worlds.scheduler_world import nixl_pull
from hotfix.worlds.timeline import Arrive, LoadFailed
from tests.worlds.verdicts import finished, run_fixed, run_stock

FIXES = ("recv-barrier", "xfer-guard", "pull-pin", "lease-guard", "nixl-settle", "load-bound", "hybrid-fail",
         "peer-reconnect")
FAILS_AT = 2


def lone_request_whose_read_fails(policy: str) -> Scenario:
    """R, alone on the engine: its READ fails at tick 2; nothing else ever arrives."""
    return Scenario((nixl_pull(),), (Arrive(0, "R", remote_prefill=True, max_tokens=2),
                                     LoadFailed(FAILS_AT, "R", "nixl")),
                    kv_load_failure_policy=policy, grace=16)


@pytest.mark.parametrize("variant", ["stock", "hotfix"])
def test_a_lone_request_recomputed_after_a_failed_load_finishes_without_new_traffic(variant):
    scenario = lone_request_whose_read_fails("recompute")
    result = run_stock(scenario) if variant == "stock" else run_fixed(scenario, *FIXES)[0]
    assert result.crash is None, result.crash.traceback
    assert result.violations == []  # every block back, no compute over a running READ
    # recomputed from the tick after the failure report, done two tokens later
    assert result.first_computed("R") == FAILS_AT + 1
    assert finished(result, "R") == (FAILS_AT + 2, "length")


@pytest.mark.parametrize("variant", ["stock", "hotfix"])
def test_a_lone_request_whose_load_fails_under_fail_ends_with_an_error_at_once(variant):
    scenario = lone_request_whose_read_fails("fail")
    result = run_stock(scenario) if variant == "stock" else run_fixed(scenario, *FIXES)[0]
    assert result.crash is None and result.violations == []
    assert finished(result, "R") == (FAILS_AT, "error") and result.first_computed("R") is None


def request_sharing_the_prompt_of_a_request_whose_read_fails() -> Scenario:
    """R READs its prompt from P; S, R's prompt exactly, arrives at tick 1 while R waits; R's
    READ fails at tick 2 and R is recomputed."""
    return Scenario((nixl_pull(),), (Arrive(0, "R", remote_prefill=True, max_tokens=2),
                                     Arrive(1, "S", same_prompt_as="R", max_tokens=4),
                                     LoadFailed(FAILS_AT, "R", "nixl")),
                    kv_load_failure_policy="recompute", grace=16)


@pytest.mark.parametrize("variant", ["stock", "hotfix"])
def test_a_request_sharing_a_failed_loads_prompt_never_shares_its_unwritten_blocks(variant):
    """D10 (vLLM #49250: under ``recompute`` a request sharing blocks with a failed load decodes
    over them while their owner recomputes) is a synchronous-load case: vLLM shares a failed
    block only among requests whose load was synchronous (``_update_requests_with_invalid_blocks``
    says async loads do not share). The loads our fixes fail are asynchronous: their target
    blocks enter the prefix cache only once the load ends, so S computes its own."""
    scenario = request_sharing_the_prompt_of_a_request_whose_read_fails()

    def holdings_at(tick: int) -> dict:  # replayed on a fresh world, stopped after ``tick``
        partial = replace(scenario, until=tick)
        return (run_stock(partial) if variant == "stock" else run_fixed(partial, *FIXES)[0]).world.holdings()

    targets = set(holdings_at(1)["R"])  # what R's READ writes (S has arrived by then)
    shared_targets = {tick: sorted(set(h.get("R", ())) & set(h.get("S", ())) & targets)
                      for tick, h in ((t, holdings_at(t)) for t in range(1, FAILS_AT + 3))}
    assert all(not blocks for blocks in shared_targets.values()), shared_targets
    # R's recompute may reuse S's blocks (computed by S, valid): sharing in that direction is fine
    result = run_stock(scenario) if variant == "stock" else run_fixed(scenario, *FIXES)[0]
    assert result.crash is None and result.violations == []
    assert finished(result, "R") == (FAILS_AT + 2, "length") and finished(result, "S")[1] == "length"
