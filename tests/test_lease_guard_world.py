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
from hotfix.fixes import lease_guard
from hotfix.fixes.lease_guard import DEADLINE_KEY, EXPIRY_KEY, LEASE_ATTR, REFUSED_ATTR
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


PREFILL = "prefill-engine"  # the scheduler world's remote engine id
SKEW_S = 10_000.0  # P's perf_counter minus D's: another host, another epoch
SLOW_BOX_S = 10.0  # what building a world and a step may add to a lease's age on a loaded box


def shipped_read(req: str, prefill_clock_offset: float | None = None, **params):
    """The ``ReqMeta`` a decode scheduler ships for R's READ in R's first step;
    ``prefill_clock_offset``: what its worker ranks reported of P's clock (None: no handshake
    with P yet, the first contact)."""
    world = World([nixl_pull()])
    if prefill_clock_offset is not None:
        lease_guard._clocks(world.child("nixl").connector_scheduler).heard(
            {"rank-0": {PREFILL: prefill_clock_offset}})
    world.scheduler.add_request(world.make_request(Arrive(0, req, remote_prefill=True,
                                                          extra_params=params)))
    output = world.scheduler.schedule()
    (nixl_metadata,) = output.kv_connector_metadata.metadata
    return nixl_metadata.reqs_to_recv[req]


def on_the_prefills_clock(seconds_from_now: float) -> float:
    """A lease end ``seconds_from_now`` away, as P's clock (SKEW_S ahead of D's) reads it."""
    return time.perf_counter() + SKEW_S + seconds_from_now


@pytest.fixture
def wall_clock_off_by(monkeypatch):
    """D's wall clock set ``s`` seconds off (NTP gone): only lease_guard's reading of it."""
    import types

    def set_skew(s: float) -> None:
        monkeypatch.setattr(lease_guard, "time", types.SimpleNamespace(
            time=lambda: time.time() + s, perf_counter=time.perf_counter))

    return set_skew


def test_a_prefill_exports_when_its_lease_ends_in_the_params_it_returns():
    stock = World([nixl_pull()])
    delay, params = stock.child("nixl").connector_scheduler.request_finished(
        stock.finished_prefill("P0"), ([1, 2, 3, 4],))
    assert delay and params["do_remote_prefill"] and DEADLINE_KEY not in params  # stock: no deadline

    with hotfix_active(FIX):
        world = World([nixl_pull()])
        before = counters()
        now = time.time()
        delay, params = world.child("nixl").connector_scheduler.request_finished(
            world.finished_prefill("P1"), ([1, 2, 3, 4],))
    assert delay and params[DEADLINE_KEY] == pytest.approx(now + LEASE_S, abs=1.0)
    # and on P's own clock, the one its NIXL handshake listener reports to a decode
    assert params[EXPIRY_KEY] == pytest.approx(time.perf_counter() + LEASE_S, abs=1.0)
    assert delta(before) == {"deadline_exported": 1}


def test_a_late_request_is_refused_before_its_read_leaves(caplog):
    assert not hasattr(shipped_read("S", **{DEADLINE_KEY: time.time() - 40}), REFUSED_ATTR)  # stock READs it

    with hotfix_active(FIX), caplog.at_level(logging.WARNING, logger="vllm.hotfix"):
        before = counters()
        past = time.time() - 40  # (after the patching, which took 5 s on a loaded box: CI)
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


@pytest.mark.parametrize("wall_skew_s", [26.0, -14.0, 60.0, -60.0])
def test_a_lease_is_judged_on_the_prefills_clock_whatever_the_hosts_wall_clocks_say(
        wall_clock_off_by, wall_skew_s):
    """Review's skew.py: D 26 s ahead refused every fresh READ, D 14 s behind trusted a lease
    that had ended 8 s before. Now the wall clocks do not enter: P's clock is D's plus the
    offset vLLM measured in the NIXL handshake (SKEW_S here)."""
    wall_clock_off_by(wall_skew_s)
    past = time.time() - 8  # the wall-clock deadline an earlier release judged by
    with hotfix_active(FIX):
        before = counters()
        fresh = shipped_read("F", SKEW_S, **{EXPIRY_KEY: on_the_prefills_clock(25),
                                             DEADLINE_KEY: time.time() + 25})
        ended = shipped_read("E", SKEW_S, **{EXPIRY_KEY: on_the_prefills_clock(-8), DEADLINE_KEY: past})
    assert not hasattr(fresh, REFUSED_ATTR) and not hasattr(fresh, LEASE_ATTR)
    assert 8 <= getattr(ended, REFUSED_ATTR) < 8 + SLOW_BOX_S
    assert delta(before) == {"lease_expired_refused": 1}


def test_a_first_contact_read_leaves_its_lease_for_the_worker_to_judge_after_the_handshake():
    """No worker rank has P's clock yet (no handshake with P): the scheduler cannot judge
    the lease on P's clock, so the READ carries it; stock ships nothing of ours."""
    assert not hasattr(shipped_read("S", **{EXPIRY_KEY: on_the_prefills_clock(-8)}), LEASE_ATTR)
    with hotfix_active(FIX):
        before = counters()
        read = shipped_read("C", **{EXPIRY_KEY: on_the_prefills_clock(-8), DEADLINE_KEY: time.time() - 8})
    assert not hasattr(read, REFUSED_ATTR)
    deadline, expiry = getattr(read, LEASE_ATTR)
    assert -8 - SLOW_BOX_S < deadline - time.time() <= -8
    assert -8 - SLOW_BOX_S < expiry - on_the_prefills_clock(0) <= -8
    assert delta(before) == {}


def test_a_heartbeat_to_a_prefill_without_a_handshake_does_not_make_its_lease_trusted():
    """Review's hb_first_contact.py: the lease was trusted at the first heartbeat the
    scheduler packaged, although NIXL's worker sends none to a prefill whose handshake is
    pending (the next comes kv_lease_duration/6 later); P freed the blocks meanwhile and the
    READ shipped unmarked. Now only a heartbeat that leaves counts."""
    from hotfix.worlds.scheduler_world import Child

    with hotfix_active(FIX):
        world = World([Child("NixlPullLoader", "nixl", kv_role="kv_consumer",
                             extra_config=(("kv_lease_duration", 120),))])
        nixl = world.child("nixl").connector_scheduler
        expiry = on_the_prefills_clock(8)  # P's lease: 8 s left when R reached D
        world.scheduler.add_request(world.make_request(Arrive(0, "R", remote_prefill=True,
                                                              extra_params={EXPIRY_KEY: expiry})))
        packaged = nixl.build_connector_meta(None)  # R waits for blocks; a heartbeat is packaged
        assert packaged.heartbeat_by_engine and "R" in nixl._hotfix_leases.pending()  # not judged
        # the handshake completes 25 s later (P's clock moved on): P freed R's blocks at +8 s
        lease_guard._clocks(nixl).heard({"rank-0": {PREFILL: SKEW_S + 25}})
        (metadata,) = world.scheduler.schedule().kv_connector_metadata.metadata
    assert 17 <= getattr(metadata.reqs_to_recv["R"], REFUSED_ATTR) < 17 + SLOW_BOX_S


def test_a_heartbeat_that_leaves_in_time_makes_the_lease_trusted_for_a_later_read():
    """From D's first heartbeat that reaches P, D renews the lease: a READ after the lease's
    first end is not refused."""
    with hotfix_active(FIX):
        world = World([nixl_pull()])
        nixl = world.child("nixl").connector_scheduler
        lease_guard._clocks(nixl).heard({"rank-0": {PREFILL: SKEW_S}})
        world.scheduler.add_request(world.make_request(Arrive(0, "R", remote_prefill=True, extra_params={
            EXPIRY_KEY: on_the_prefills_clock(20)})))
        assert nixl.build_connector_meta(None).heartbeat_by_engine  # leaves: P has 20 s left
        assert "R" not in nixl._hotfix_leases.pending()  # trusted
        lease_guard._clocks(nixl).heard({"rank-0": {PREFILL: SKEW_S + 60}})  # the READ, a minute on
        (metadata,) = world.scheduler.schedule().kv_connector_metadata.metadata
    read = metadata.reqs_to_recv["R"]
    assert not hasattr(read, REFUSED_ATTR) and not hasattr(read, LEASE_ATTR)


# ---------------------------------------------------------------------------------------
# The decode worker: vLLM's real NIXL worker, a fake NIXL agent
# ---------------------------------------------------------------------------------------

@pytest.fixture
def decode(decode_worlds):
    return decode_worlds


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


@pytest.fixture
def prefill_clock_ahead(monkeypatch):
    """The prefill's handshake listener reports its perf_counter SKEW_S ahead of this
    process's (another host), so vLLM's handshake measures that offset."""
    import types

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler

    real = base_scheduler.time
    monkeypatch.setattr(base_scheduler, "time", types.SimpleNamespace(
        perf_counter=lambda: real.perf_counter() + SKEW_S, time=real.time, sleep=real.sleep,
        monotonic=real.monotonic))


@pytest.mark.parametrize("left_s, declined", [(-8.0, True), (3.0, True), (25.0, False)])
def test_a_first_contact_read_is_judged_where_it_is_posted_on_the_prefills_clock(
        decode, prefill_clock_ahead, left_s, declined):
    """The READ the scheduler could not judge: after the handshake the worker converts P's
    lease end with the measured offset; ended or inside the margin (5 s): declined before any
    byte moves; with room: NIXL's own READ."""
    lease = (None, on_the_prefills_clock(left_s))
    stock = read_into(decode(), **{LEASE_ATTR: lease})
    assert len(stock.worker._recving_transfers["R"]) == 2  # stock reads whatever P holds
    assert stock.worker._engine_clock_offset[PREFILL] == pytest.approx(SKEW_S, abs=1)

    with hotfix_active(FIX):
        before = counters()
        lease = (None, on_the_prefills_clock(left_s))
        world = declined_read(decode(), before, **{LEASE_ATTR: lease}) if declined else \
            read_into(decode(), **{LEASE_ATTR: lease})
    if declined:
        assert world.agent.handles_to(world.prefill_agent(0)) == []
        assert delta(before) == {"lease_expired_refused": 1, "read_declined": 1}
    else:
        assert len(world.worker._recving_transfers["R"]) == 2 and delta(before) == {}


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

