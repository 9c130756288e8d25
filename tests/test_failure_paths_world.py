"""The failed-load path our fixes route into (issue #27), in the scheduler world, every release.

D11 (reported on a 0.27 fork: "a recompute after a failed load does not wake an idle engine;
the request waits until the next request arrives") does not reproduce on stock vLLM: the
world stops ticking as soon as ``Scheduler.has_requests()`` is False (what lets the real
EngineCore block on its input queue), and a lone request whose NIXL READ failed is still
recomputed and finished without any other traffic, stock and with every fix on. vLLM counts
``skipped_waiting`` (where the failed request waits) in ``get_num_unfinished_requests``.
"""
from __future__ import annotations

import pytest

from hotfix.worlds.scenarios import Scenario
from hotfix.worlds.scheduler_world import nixl_pull
from hotfix.worlds.timeline import Arrive, LoadFailed
from tests.worlds.verdicts import finished, run_fixed, run_stock

FIXES = ("recv-barrier", "xfer-guard", "pull-pin", "lease-guard", "nixl-settle", "load-bound", "hybrid-fail")
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
