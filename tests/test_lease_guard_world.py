"""lease-guard (D6) on vLLM's real NIXL code, in-process.

Scheduler side: vLLM's real Scheduler, MultiConnector and ``NixlPullConnectorScheduler``
(the scheduler world); a prefill's ``request_finished`` exports its lease's deadline, and a
decode's first schedule of a late request marks the READ it ships. Each test schedules once,
so the halves' handshake is still waiting for its first output (``may_act``): what a patched
engine does in every step once its workers answered. Worker side: vLLM's real decode-side
NIXL worker (only the NIXL agent is a double, ``hotfix.worlds.nixl_worker``) declines a marked
READ the way it declines an expired turn-2 readback: no READ handle, R reported failed with
its blocks invalid — while stock vLLM READs it.
"""
from __future__ import annotations

import logging
import time

import pytest

from hotfix import status
from hotfix.fixes.lease_guard import DEADLINE_KEY, REFUSED_ATTR
from hotfix.worlds.hotfix_on import hotfix_active
from hotfix.worlds.scheduler_world import World, nixl_pull
from hotfix.worlds.timeline import Arrive

FIX = "lease-guard"
LEASE_S = 30  # NIXL's default kv_lease_duration


def counters() -> dict:
    return dict(status.counters().get(FIX, {}))


def delta(before: dict) -> dict:
    after = counters()
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def shipped_read(req: str, **params):
    """The ``ReqMeta`` a decode scheduler ships for R's READ in R's first step."""
    world = World([nixl_pull()])
    world.scheduler.add_request(world.make_request(Arrive(0, req, remote_prefill=True,
                                                          extra_params=params)))
    output = world.scheduler.schedule()
    (nixl_metadata,) = output.kv_connector_metadata.metadata
    return nixl_metadata.reqs_to_recv[req]


def finished_prefill(world: World, req: str):
    from vllm.v1.request import RequestStatus

    request = world.make_request(Arrive(0, req))
    request.kv_transfer_params = {"do_remote_decode": True}
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    request.num_computed_tokens = 64
    return request


def test_a_prefill_exports_when_its_lease_ends_in_the_params_it_returns():
    stock = World([nixl_pull()])
    delay, params = stock.child("nixl").connector_scheduler.request_finished(
        finished_prefill(stock, "P0"), ([1, 2, 3, 4],))
    assert delay and params["do_remote_prefill"] and DEADLINE_KEY not in params  # stock: no deadline

    with hotfix_active(FIX):
        world = World([nixl_pull()])
        before = counters()
        now = time.time()
        delay, params = world.child("nixl").connector_scheduler.request_finished(
            finished_prefill(world, "P1"), ([1, 2, 3, 4],))
    assert delay and params[DEADLINE_KEY] == pytest.approx(now + LEASE_S, abs=1.0)
    assert delta(before) == {"deadline_exported": 1}


def test_a_late_request_is_refused_before_its_read_leaves(caplog):
    past = time.time() - 40
    assert not hasattr(shipped_read("S", **{DEADLINE_KEY: past}), REFUSED_ATTR)  # stock READs it

    with hotfix_active(FIX), caplog.at_level(logging.WARNING, logger="vllm.hotfix"):
        before = counters()
        read = shipped_read("L", **{DEADLINE_KEY: past})
    assert getattr(read, REFUSED_ATTR) == pytest.approx(40, abs=2)
    assert delta(before) == {"lease_expired_refused": 1}
    assert any("hotfix.lease.expired_refused" in r.getMessage() for r in caplog.records)


def test_a_lease_inside_the_margin_is_refused_and_one_with_room_is_read(monkeypatch):
    with hotfix_active(FIX):
        before = counters()
        assert not hasattr(shipped_read("T", **{DEADLINE_KEY: time.time() + 20}), REFUSED_ATTR)
        assert delta(before) == {}  # in time: nothing counted, nothing changed
        monkeypatch.setenv("HOTFIX_LEASE_GUARD_MARGIN_S", "30")
        assert getattr(shipped_read("M", **{DEADLINE_KEY: time.time() + 20}), REFUSED_ATTR) < 0


def test_a_request_without_a_deadline_is_read_as_stock_with_one_warning(caplog):
    with hotfix_active(FIX), caplog.at_level(logging.WARNING, logger="vllm.hotfix"):
        before = counters()
        reads = [shipped_read(f"N{i}") for i in range(2)]
    assert not any(hasattr(r, REFUSED_ATTR) for r in reads)
    assert delta(before) == {"deadline_missing": 2}
    warned = [r for r in caplog.records if "hotfix.lease.no_deadline" in r.getMessage()]
    assert len(warned) <= 1  # once per process (an earlier test may have used the line)


@pytest.mark.parametrize("garbled", ["in 30 s", True, float("nan"), -1.0, [1.0]])
def test_a_garbled_deadline_is_one_error_and_a_stock_read(caplog, garbled):
    with hotfix_active(FIX), caplog.at_level(logging.ERROR, logger="vllm.hotfix"):
        before = counters()
        read = shipped_read("G", **{DEADLINE_KEY: garbled})
    assert not hasattr(read, REFUSED_ATTR)
    assert delta(before) == {"deadline_garbled": 1}


# ---------------------------------------------------------------------------------------
# The decode worker: vLLM's real NIXL worker, a fake NIXL agent
# ---------------------------------------------------------------------------------------

@pytest.fixture
def decode(monkeypatch):
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    from vllm.platforms import current_platform

    if not current_platform.device_type:  # a --no-deps vLLM (the 0.33.0 leg): no platform
        pytest.skip("NIXL's worker needs a vLLM platform with a device type")
    from hotfix.worlds.nixl_worker import DecodeWorld

    worlds = []

    def build():
        worlds.append(DecodeWorld(monkeypatch))
        return worlds[-1]

    yield build
    for w in worlds:
        w.close()


def read_into(world, **marks):
    world.load("R", [1, 2], [5, 6], **marks)
    world.wait_for_handshake("R")
    world.start()  # the READ starts once the handshake is done
    return world


def declined_read(world, before: dict, **marks):
    """R's marked READ: 0.27-0.29 reach the decline once the background handshake is done,
    0.30+ before any handshake (the READ path starts it); steps until the worker declined."""
    world.load("R", [1, 2], [5, 6], **marks)
    deadline = time.monotonic() + 10
    while not delta(before) and time.monotonic() < deadline:
        time.sleep(0.02)
        world.start()
    return world


def test_a_refused_read_fails_before_any_byte_moves_and_stock_reads_it(decode):
    stock = read_into(decode(), **{REFUSED_ATTR: 12.0})
    assert len(stock.worker._recving_transfers["R"]) == 2  # stock READs the expired blocks

    with hotfix_active(FIX):
        before = counters()
        fixed = declined_read(decode(), before, **{REFUSED_ATTR: 12.0})
        recving, invalid = fixed.finished()
    assert not fixed.worker._recving_transfers.get("R")
    assert fixed.agent.handles_to(fixed.prefill_agent(0)) == []  # no READ was posted
    assert "R" in recving  # reported once, as a failed load
    assert invalid in ({1, 2}, set())  # 0.27-0.29 report the blocks; 0.30+ the failed id
    assert delta(before) == {"read_declined": 1}


def test_an_unmarked_read_is_nixls_own_with_the_fix(decode):
    with hotfix_active(FIX):
        before = counters()
        fixed = read_into(decode())
    assert len(fixed.worker._recving_transfers["R"]) == 2
    assert delta(before) == {}


def test_a_nixl_scheduler_built_without_its_config_gets_stock_metadata(caplog):
    """vLLM's own unit tests build NIXL's scheduler with ``object.__new__`` and a few fields
    (tests/v1/kv_connector/unit/test_nixl_heartbeat.py): no ``vllm_config``, so no handshake
    can be sized. The step's metadata must come back as stock builds it, with one ERROR."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler)

    real = World([nixl_pull()]).child("nixl").connector_scheduler
    bare = object.__new__(NixlPullConnectorScheduler)
    bare.__dict__.update({k: v for k, v in vars(real).items() if k != "vllm_config"})
    with hotfix_active(FIX), caplog.at_level(logging.ERROR, logger="vllm.hotfix"):
        metadata = bare.build_connector_meta(None)
    assert metadata.reqs_to_recv == {}
    assert any("hotfix.runtime.error" in r.getMessage() for r in caplog.records)


def test_a_decline_whose_accounting_fails_still_declines_and_never_reaches_the_worker(decode, monkeypatch):
    """The count and log line after a decline ran outside the hook's containment: an error
    there escaped into NIXL's worker (an EngineCore death). Contained now, the READ stays
    declined (not issued after all) and the error is counted."""
    from hotfix.fixes import lease_guard

    def broken(kind):
        if kind == "read_declined":
            raise RuntimeError("status unavailable")
        return real(kind)

    real = lease_guard._count
    monkeypatch.setattr(lease_guard, "_count", broken)
    with hotfix_active(FIX):
        before = counters()
        world = declined_read(decode(), before, **{REFUSED_ATTR: 12.0})
        recving, _ = world.finished()
    assert "R" in recving and not world.worker._recving_transfers.get("R")
    assert world.agent.handles_to(world.prefill_agent(0)) == []
    assert delta(before) == {"internal_error": 1}


def test_push_mode_has_no_lease_handshake_and_no_false_degraded_error():
    """NIXL push mode (P writes into D): no pull worker exists to announce lease-guard's worker
    half, so stamping there made every push-mode EngineCore log a false hotfix.halves.degraded
    ERROR. The scheduler half now stamps only NIXL's pull scheduler."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
        NixlPushConnectorScheduler)

    from hotfix.halves import STAMP_ATTR

    real = World([nixl_pull()]).child("nixl").connector_scheduler
    with hotfix_active(FIX):
        push = NixlPushConnectorScheduler(real.vllm_config, real.engine_id, real.kv_cache_config)
        metadata = push.build_connector_meta(None)
        pulled = real.build_connector_meta(None)
    assert FIX not in (getattr(metadata, STAMP_ATTR, None) or {})
    assert "_hotfix_lease_half" not in push.__dict__
    assert FIX in getattr(pulled, STAMP_ATTR)  # the pull scheduler still stamps
