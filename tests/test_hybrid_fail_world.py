"""hybrid-fail (D9): a failed NIXL READ on a hybrid KV cache reaches the scheduler as a failed
load, never as a loaded request (vLLM 0.27-0.29; 0.30+ does it itself, shown here too).

The worker side runs vLLM's real NIXL worker over a NIXL-agent double (``DecodeWorld``) with
``_is_hma_required`` set, as a model with a sliding-window or mamba group sets it; its READ fails
(both handles ``ERR``) or lease-guard declines it. The scheduler side runs vLLM's real scheduler
on a KV cache of two groups (full attention + a 32-token sliding window) and hands it what the
worker reported.
"""
from __future__ import annotations

import pytest
from vllm.v1.outputs import KVConnectorOutput

from hotfix import registry, status
from hotfix.fixes import hybrid_fail
from hotfix.fixes.lease_guard import REFUSED_ATTR
from hotfix.halves import SchedulerHalf
from hotfix.worlds.hotfix_on import hotfix_active
from hotfix.worlds.nixl_worker import DecodeWorld
from hotfix.worlds.scheduler_world import FAILED_RECVS_SUPPORTED, World, nixl_pull, runner_output
from hotfix.worlds.timeline import Arrive

FIX = hybrid_fail.FIX
AFFECTED = registry.decide(hybrid_fail.SPEC, mode="on").reason == "known_shape"
pre_030 = pytest.mark.skipif(not AFFECTED, reason="vLLM 0.30+ reports failed_recving itself")


def test_the_fix_applies_up_to_029_and_is_fixed_upstream_from_030():
    assert registry.decide(hybrid_fail.SPEC, mode="on").reason == (
        "fixed_upstream" if FAILED_RECVS_SUPPORTED else "known_shape")


# ---------------------------------------------------------------------------------------
# The decode worker
# ---------------------------------------------------------------------------------------

@pytest.fixture
def hybrid_worker(monkeypatch):
    from vllm.platforms import current_platform

    if not current_platform.device_type:  # a --no-deps vLLM (the 0.33.0 leg): no platform
        pytest.skip("NIXL's worker needs a vLLM platform with a device type")
    worlds = []

    def build(stamped: bool):
        """A decode worker on a hybrid KV cache; ``stamped``: its EngineCore runs the fix."""
        stamp = (lambda md: SchedulerHalf(FIX, 1).stamp(md)) if stamped else None
        worlds.append(DecodeWorld(monkeypatch, stamp=stamp))
        worlds[-1].worker._is_hma_required = True
        return worlds[-1]

    yield build
    for w in worlds:
        w.close()


def failed_read(world):
    """R's READ (two handles, one per prefill rank) fails on both; the step's report."""
    world.load("R", [1, 2], [5, 6])
    world.wait_for_handshake("R")
    world.start()
    for rank in (0, 1):
        for handle in world.agent.handles_to(world.prefill_agent(rank)):
            world.agent.finish(handle, "ERR")
    return report(world)


def declined_read(world):
    """R's READ refused by lease-guard (its lease lapsed) and declined before any byte moves."""
    world.load("R", [1, 2], [5, 6], **{REFUSED_ATTR: 12.0})
    world.wait_for_handshake("R")
    world.start()
    return report(world)


def report(world):
    """(finished, failed, invalid blocks) the worker reports for R once it reports it."""
    for _ in range(200):
        if FAILED_RECVS_SUPPORTED:
            results = world.connector.get_transfer_results(set())
            recving, failed = set(results.finished_recving or ()), set(results.failed_recving or ())
        else:
            _, recving = world.connector.get_finished(set())
            recving, failed = set(recving or ()), set()
        invalid = world.connector.get_block_ids_with_load_errors()
        if recving or failed:
            return recving, failed, invalid
        world.start()
    raise AssertionError("R was never reported")


@pre_030
@pytest.mark.parametrize("fail", [failed_read, declined_read], ids=["read-failed", "lease-declined"])
def test_a_failed_read_on_a_hybrid_cache_reports_the_blocks_of_every_group_invalid(hybrid_worker, fail):
    """Stock 0.27-0.29: R reported with no invalid block, i.e. as loaded (the red)."""
    fixes = ("lease-guard",) if fail is declined_read else ()
    with hotfix_active(*fixes):
        assert fail(hybrid_worker(stamped=False)) == ({"R"}, set(), set())
    with hotfix_active(FIX, *fixes):
        before = status.counters().get(FIX, {})
        assert fail(hybrid_worker(stamped=True)) == ({"R"}, set(), {1, 2})
        unstamped = hybrid_worker(stamped=False)  # the EngineCore does not run the fix
        assert fail(unstamped) == ({"R"}, set(), set())  # stock: it could not take the blocks
    assert unstamped.worker._hotfix_hybrid_half.state == "degraded"
    assert status.counters().get(FIX, {}) == before  # counted by the scheduler, not here


@pytest.mark.skipif(AFFECTED, reason="0.27-0.29: the fix's own test above")
def test_from_030_stock_reports_a_failed_hybrid_read_as_failed(hybrid_worker):
    recving, failed, _ = failed_read(hybrid_worker(stamped=False))
    assert "R" in failed and "R" in recving


# ---------------------------------------------------------------------------------------
# The scheduler
# ---------------------------------------------------------------------------------------

def hybrid_scheduler_after(report: KVConnectorOutput, policy: str):
    """vLLM's scheduler on a two-group KV cache: R waits for NIXL, then gets ``report``; the
    next step. Returns (the world, what escaped, R's status, R's blocks in the prefix cache,
    R's tokens scheduled in that step)."""
    world = World([nixl_pull()], sliding_window=32, kv_load_failure_policy=policy)
    scheduler = world.scheduler
    scheduler.add_request(world.make_request(Arrive(0, "R", remote_prefill=True, prompt_len=64)))
    out = scheduler.schedule()
    assert scheduler.requests["R"].status.name == "WAITING_FOR_REMOTE_KVS"
    kv = report if not callable(report) else report(scheduler)
    try:
        scheduler.update_from_output(out, runner_output(kv_connector_output=kv))
    except Exception as exc:  # what would kill the EngineCore
        return world, exc, None, 0, None
    nxt = scheduler.schedule()
    request = scheduler.requests.get("R")
    blocks = scheduler.kv_cache_manager.get_blocks("R").blocks if request else ()
    cached = sum(b.block_hash is not None for g in blocks for b in g if not b.is_null)
    return world, None, request.status.name if request else "gone", cached, nxt.num_scheduled_tokens.get("R")


def stock_worker_report(scheduler) -> KVConnectorOutput:
    if FAILED_RECVS_SUPPORTED:
        return KVConnectorOutput(finished_recving={"R"}, failed_recving={"R"})
    return KVConnectorOutput(finished_recving={"R"})  # 0.27-0.29: as if loaded


def fixed_worker_report(scheduler) -> KVConnectorOutput:
    blocks = {b for g in scheduler.kv_cache_manager.get_block_ids("R") for b in g}
    return KVConnectorOutput(finished_recving={"R"}, invalid_block_ids=blocks)


@pre_030
def test_stock_scheduler_decodes_and_caches_a_failed_hybrid_load_and_cannot_take_its_blocks():
    _, crash, state, cached, scheduled = hybrid_scheduler_after(stock_worker_report, "fail")
    assert crash is None and state == "RUNNING" and cached > 0 and scheduled  # garbage, cached
    _, crash, *_ = hybrid_scheduler_after(fixed_worker_report, "fail")
    assert isinstance(crash, ValueError)  # "(req_block_ids,) = ..." of one group: EngineCore death


@pre_030
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_hybrid_load_fails_or_recomputes_in_fresh_blocks_never_cached(policy):
    with hotfix_active(FIX):
        before = status.counters().get(FIX, {}).get("hybrid_failed_load", 0)
        world, crash, state, cached, scheduled = hybrid_scheduler_after(fixed_worker_report, policy)
    assert crash is None
    if policy == "fail":
        assert state == "gone" and scheduled is None  # finished with an error, blocks freed
    else:  # computed again from token 0: no block of the failed load was taken as a prefix hit
        assert state == "RUNNING" and scheduled == 64
    assert world.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() > 0
    assert status.counters()[FIX]["hybrid_failed_load"] == before + 1


@pytest.mark.skipif(AFFECTED, reason="0.27-0.29: the fix's own tests above")
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_from_030_stock_scheduler_applies_the_policy_to_a_failed_hybrid_load(policy):
    _, crash, state, cached, scheduled = hybrid_scheduler_after(stock_worker_report, policy)
    assert crash is None
    assert (state, scheduled) == (("gone", None) if policy == "fail" else ("RUNNING", 64))
