"""pull-pin and cascade attention: the common-prefix count the scheduler hands the model runner.

vLLM 0.27-0.31 compute ``num_common_prefix_blocks`` in every ``schedule()`` (cascade attention
uses it when ``disable_cascade_attn=False``): the leading blocks of ``running[0]`` whose
``ref_cnt`` equals the number of requests with blocks. A pin is one more reference, so a
pinned block held by all but one request would count as common to all: cascade attention
would then run that request's attention over another request's KV.

A pin only matters there while a *running* request holds a pinned block, i.e. while a NIXL
READ still writes into blocks of a request already promoted: early promotion (D1, which
recv-barrier prevents; pull-pin must hold with the other fixes off) and what that request's
cached blocks pass on to a prefix-cache hit. Each scenario asserts it reaches such a step
(the ref_cnt rule and membership disagree on the pinned run's state), so these tests fail if
pins changed the count, and cannot pass vacuously.
"""
from __future__ import annotations

import inspect

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from hotfix.worlds import scenarios
from hotfix.worlds.scenarios import LONG_REMOTE_R, Scenario
from hotfix.worlds.timeline import Abort, Arrive, LoadDone, Preempt
from hotfix.worlds.tracker import WRITE_INTO_FREED, WRITE_INTO_REALLOCATED
from tests.worlds.verdicts import run_fixed, run_stock

pytestmark = pytest.mark.skipif(
    "get_num_common_prefix_blocks" not in inspect.getsource(Scheduler.schedule),
    reason="this vLLM computes no common prefix (cascade attention removed in 0.32)",
)

FIX = "pull-pin"
# R (NIXL pulls it, the buggy LMCache promotes it at 1) runs first; S, same prompt, takes
# R's cached blocks, still pinned under NIXL's READ; X shares nothing. NIXL's READ ends at 9.
SHARED = (LONG_REMOTE_R, LoadDone(1, "R", "lmc"), Arrive(3, "S", same_prompt_as="R", max_tokens=12),
          Arrive(3, "X", max_tokens=12), LoadDone(9, "R", "nixl"))

PINNED_PREFIX_SHARED_BY_RUNNING = Scenario(scenarios.BUG_REPORT, SHARED, until=8)
# ... R aborted at 5: S holds R's pinned blocks alone (with X beside it)
PINNED_PREFIX_AFTER_ABORT = Scenario(scenarios.BUG_REPORT, SHARED + (Abort(5, "R"),), until=8)
# ... R preempted at 5: its blocks back in the cache, still pinned; it resumes on them
PINNED_PREFIX_AFTER_PREEMPTION = Scenario(scenarios.BUG_REPORT, SHARED + (Preempt(5, "R"),), until=8)
# no sharing at all: R alone with X; R's own pinned blocks are running[0]'s prefix
PINNED_PREFIX_OF_A_LONE_REQUEST = Scenario(
    scenarios.BUG_REPORT,
    (LONG_REMOTE_R, LoadDone(1, "R", "lmc"), Arrive(3, "X", max_tokens=12), LoadDone(9, "R", "nixl")),
    until=8)


def stock_sound_until(stock) -> int:
    """The last tick at which stock still allocates like the pinned run (before it frees a
    block under the READ, or dies)."""
    bad = [v.step for v in stock.tracker.of_kind(WRITE_INTO_FREED) + stock.tracker.of_kind(WRITE_INTO_REALLOCATED)]
    if stock.crash is not None:
        bad.append(stock.crash.step)
    return min(bad, default=stock.steps[-1].step + 1) - 1


@pytest.mark.parametrize("scenario", [PINNED_PREFIX_SHARED_BY_RUNNING, PINNED_PREFIX_AFTER_ABORT,
                                      PINNED_PREFIX_AFTER_PREEMPTION, PINNED_PREFIX_OF_A_LONE_REQUEST],
                         ids=["shared_by_running", "after_abort", "after_preemption", "lone_request"])
@pytest.mark.parametrize("fixes", [(FIX,), (FIX, "xfer-guard")], ids=["alone", "with_xfer_guard"])
def test_common_prefix_count_with_pinned_reads_equals_stocks(scenario, fixes):
    stock = run_stock(scenario)
    for s in stock.steps:  # stock: one reference per holder, so both readings agree
        assert s.common_prefix == s.common_prefix_by_holders == s.common_prefix_by_ref_cnt, s.step

    fixed, states = run_fixed(scenario, *fixes)
    assert states[FIX]["state"] == "applied"
    # precondition: a pinned block sits in the prefix the count examines (the ref_cnt rule
    # sees one reference more than there are holders)
    assert [s.step for s in fixed.steps if s.common_prefix_by_ref_cnt != s.common_prefix_by_holders]

    for s in fixed.steps:  # the count the model runner gets never names a block someone lacks
        assert s.common_prefix == s.common_prefix_by_holders, (s.step, s.common_prefix_by_ref_cnt)
    sound = stock_sound_until(stock)
    compared = [(s.step, s.common_prefix) for s in fixed.steps if s.step <= sound]
    assert compared == [(s.step, s.common_prefix) for s in stock.steps if s.step <= sound]
