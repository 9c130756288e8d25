"""lease-guard's confirmation (D6b, issue #27; a renewed lease, issue #32 item 3) on vLLM's real NIXL code.

Worker side: vLLM's real decode-side NIXL worker and the prefill's real handshake listener
(``hotfix.worlds.nixl_worker``: only the NIXL agent is a double, and it records the
notifications a READ's completion or ``send_notif`` sends). Scheduler side: vLLM's real
scheduler with NIXL's pull scheduler (the scheduler world), as prefill and as decode.

A READ during which the prefill's lease lapsed copies whatever P has written into the blocks
since: stock reports it loaded (asserted). With the fix the READ leaves without NIXL's
completion notification, and once it is done P's listener is asked whether P still holds the
request's blocks: yes -> reported, notification sent; no -> failed load (invalid blocks), no
notification; silent -> asked again while a question ends within the load bound, then failed
load, notification sent; nothing listening -> failed load at once.
"""
from __future__ import annotations

import time

import pytest

from hotfix import log, status
from hotfix.fixes import lease_guard
from hotfix.fixes._lease_confirm import HELD
from hotfix.fixes.lease_guard import CONFIRM_ATTR, CONFIRM_KEY, DEADLINE_KEY, REFUSED_ATTR
from hotfix.worlds.hotfix_on import hotfix_active
from hotfix.worlds.scheduler_world import World, nixl_pull
from hotfix.worlds.timeline import Arrive

FIX = "lease-guard"
LOCAL, REMOTE = [1, 2], [5, 6]


def counters() -> dict:
    return dict(status.counters().get(FIX, {}))


def delta(before: dict) -> dict:
    after = counters()
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


@pytest.fixture(autouse=True)
def prefill_holds_nothing():
    """Each test starts with P holding nothing and leaves the process as it found it (P's
    book, and the log's rate limits: a later test may wait for a line this one logged)."""
    HELD.release(list(HELD._held))
    listening = HELD.listening
    yield
    HELD.release(list(HELD._held))
    HELD.listening = listening
    log.reset_rate_limits()


# ---------------------------------------------------------------------------------------
# Scheduler side: P offers, D leaves the READ to P
# ---------------------------------------------------------------------------------------

def test_a_prefill_whose_listener_answers_offers_to_confirm_and_holds_until_the_blocks_are_freed():
    from vllm.v1.outputs import KVConnectorOutput

    with hotfix_active(FIX):
        world = World([nixl_pull()])
        connector = world.child("nixl")
        HELD.listening = False  # no listener of ours started in this process
        _, quiet = connector.connector_scheduler.request_finished(world.finished_prefill("P0"), ([1, 2],))
        HELD.listening = True
        _, offered = connector.connector_scheduler.request_finished(world.finished_prefill("P1"), ([3, 4],))
        held_after_finish = HELD.held(["P0", "P1"])
        connector.update_connector_output(KVConnectorOutput(finished_sending={"P1"}))
    assert CONFIRM_KEY not in quiet and offered[CONFIRM_KEY] == lease_guard.CONFIRM_WIRE
    assert held_after_finish == ["P1"] and HELD.held(["P1"]) == []  # freed in that step


def shipped_read(req: str, **params):
    world = World([nixl_pull()])
    world.scheduler.add_request(world.make_request(Arrive(0, req, remote_prefill=True, extra_params=params)))
    (nixl_metadata,) = world.scheduler.schedule().kv_connector_metadata.metadata
    return nixl_metadata.reqs_to_recv[req]


def test_a_lease_past_its_first_end_is_read_and_left_to_the_prefill_when_it_offers_to_confirm():
    """A router's retry on a second decode after the first one's heartbeats renewed P's lease:
    by its first end the lease lapsed 40 s ago, but P may still hold the blocks; only P can
    say. Without P's offer the READ is refused as before."""
    with hotfix_active(FIX):
        past = time.time() - 40
        offered = shipped_read("R", **{DEADLINE_KEY: past, CONFIRM_KEY: lease_guard.CONFIRM_WIRE})
        not_offered = shipped_read("S", **{DEADLINE_KEY: past})
    assert getattr(offered, CONFIRM_ATTR) == (past, None) and not hasattr(offered, REFUSED_ATTR)
    assert getattr(not_offered, REFUSED_ATTR) == pytest.approx(40, abs=10)


def test_a_decode_with_the_confirmation_turned_off_judges_by_the_deadline(monkeypatch):
    monkeypatch.setenv("HOTFIX_LEASE_CONFIRM_TIMEOUT_S", "0")
    with hotfix_active(FIX):
        read = shipped_read("R", **{DEADLINE_KEY: time.time() - 40, CONFIRM_KEY: lease_guard.CONFIRM_WIRE})
    assert not hasattr(read, CONFIRM_ATTR) and hasattr(read, REFUSED_ATTR)


# ---------------------------------------------------------------------------------------
# The decode worker: vLLM's real NIXL worker, a fake NIXL agent, P's real listener
# ---------------------------------------------------------------------------------------

@pytest.fixture
def decode(decode_worlds):
    return decode_worlds


def read_done(world, **marks):
    """R's READ (two handles: P has TP=2) posted, then done on both prefill ranks."""
    world.load("R", LOCAL, REMOTE, **marks)
    world.wait_for_handshake("R")
    world.start()
    handles = list(world.worker._recving_transfers["R"])
    assert len(handles) == 2
    for handle in handles:
        world.agent.finish(handle)
    return world


def reported(world, timeout: float = 10.0):
    """Worker steps until R is reported: (recving, invalid blocks, steps it took)."""
    deadline, steps = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        steps += 1
        recving, invalid = world.finished()
        if "R" in recving:
            return recving, invalid, steps
        time.sleep(0.02)
    raise AssertionError(f"R never reported; counters {counters()}")


NOTIFIED = {("prefill-agent-rank0", b"prefill-R:1"), ("prefill-agent-rank1", b"prefill-R:1")}


def test_stock_reports_a_read_loaded_as_soon_as_nixl_says_done_whatever_p_did_meanwhile(decode):
    """The red: nothing asks P whether the lease held through the READ."""
    world = read_done(decode(), **{CONFIRM_ATTR: (None, None)})
    recving, invalid, steps = reported(world)
    assert steps == 1 and invalid == set()  # loaded: decoded over whatever the READ copied
    assert set(world.agent.notified) == NOTIFIED  # NIXL notified P at completion


def test_a_read_is_reported_only_after_the_prefill_said_it_still_held_the_blocks(decode):
    with hotfix_active(FIX):
        world = decode()
        HELD.hold("prefill-R")
        before = counters()
        world = read_done(world, **{CONFIRM_ATTR: (None, None)})
        assert all(not world.agent.notif_of[h] for h in world.agent.peer_of)  # posted without
        assert world.agent.notified == []  # nothing told P yet: it keeps the blocks
        recving, invalid, _ = reported(world)
    # reported on P's answer: the step that asks collects the answers right after, so a quick
    # listener's yes can come in that very step (CI once saw 1 step, 0.28.0 leg); what proves
    # the order is that nothing told P before the report, and the confirmation counted
    assert invalid == set()
    assert set(world.agent.notified) == NOTIFIED  # then P is told, as NIXL would have
    assert delta(before) == {"read_to_confirm": 1, "read_confirmed": 1}


def test_a_read_during_which_the_lease_lapsed_fails_through_the_failed_load_path(decode):
    with hotfix_active(FIX):
        world = decode()  # P holds nothing: it freed R's blocks before or during the READ
        before = counters()
        world = read_done(world, **{CONFIRM_ATTR: (None, None)})
        recving, invalid, _ = reported(world)
    assert invalid in ({1, 2}, set())  # 0.27-0.29 report the blocks; 0.30+ the failed id
    assert world.worker.get_block_ids_with_load_errors() == set()
    assert world.agent.notified == []  # P no longer holds them: nothing to free
    assert delta(before) == {"read_to_confirm": 1, "read_unconfirmed": 1}


def stall_the_listener(monkeypatch, seconds: float) -> list:
    """P's listener thread stands still ``seconds`` on the first question it gets (its
    EngineCore starved or stalled), then answers as before; returns when it stalled."""
    answer, stalled = HELD.held, []

    def held_after_a_stall(req_ids):
        if not stalled:
            stalled.append(time.monotonic())
            time.sleep(seconds)
        return answer(req_ids)

    monkeypatch.setattr(HELD, "held", held_after_a_stall)
    return stalled


def test_no_answer_within_the_bound_fails_the_load_and_lets_the_prefill_free_the_blocks(decode, monkeypatch):
    monkeypatch.setenv("HOTFIX_LEASE_CONFIRM_TIMEOUT_S", "0.5")
    monkeypatch.setenv("HOTFIX_LOAD_TIMEOUT_S", "1.5")  # asked again while a question ends by then
    with hotfix_active(FIX):
        world = decode()
        HELD.hold("prefill-R")
        stalled = stall_the_listener(monkeypatch, 2.5)  # silent past the bound
        before = counters()
        world = read_done(world, **{CONFIRM_ATTR: (None, None)})
        began = time.monotonic()
        reported(world)
    assert stalled and 1.0 <= time.monotonic() - began < 5
    assert set(world.agent.notified) == NOTIFIED  # P may still hold them: it frees them now
    counted = delta(before)
    assert counted.pop("confirm_asked_again", 0) >= 1
    assert counted == {"read_to_confirm": 1, "confirm_unanswered": 1}


def test_a_prefill_whose_listener_is_gone_fails_the_load_at_once(decode, monkeypatch):
    """Nothing listens at P's side channel any more (its process died after the READ): there
    is nothing to wait for, whatever the load bound."""
    monkeypatch.setenv("HOTFIX_LEASE_CONFIRM_TIMEOUT_S", "0.5")
    monkeypatch.setenv("HOTFIX_LOAD_TIMEOUT_S", "30")
    with hotfix_active(FIX):
        world = decode()
        HELD.hold("prefill-R")
        world.load("R", LOCAL, REMOTE, **{CONFIRM_ATTR: (None, None)})
        world.wait_for_handshake("R")
        world.start()
        world._stop.set()  # P's listener closes its socket after the handshake
        world._listener.join(timeout=3)
        before = counters()
        for handle in list(world.worker._recving_transfers["R"]):
            world.agent.finish(handle)
        began = time.monotonic()
        reported(world)
    assert time.monotonic() - began < 5
    assert set(world.agent.notified) == NOTIFIED
    assert delta(before) == {"confirm_unanswered": 1}


@pytest.mark.parametrize("load_timeout", ["0", "10"])
def test_a_stalled_prefills_late_yes_reports_the_read_when_the_worker_waits_for_it(decode, monkeypatch, load_timeout):
    """P's EngineCore stalls past one question's timeout, then answers that it held the blocks:
    the READ was right. Asking once (the load bound off: one question) failed it, so a healthy
    but slow prefill turned into an error under ``kv_load_failure_policy=fail`` (seen in the
    serving world, issue #30): the red. Asked again until the load bound, it is reported loaded."""
    monkeypatch.setenv("HOTFIX_LEASE_CONFIRM_TIMEOUT_S", "0.5")
    monkeypatch.setenv("HOTFIX_LOAD_TIMEOUT_S", load_timeout)
    with hotfix_active(FIX):
        world = decode()
        HELD.hold("prefill-R")
        stalled = stall_the_listener(monkeypatch, 1.2)
        before = counters()
        world = read_done(world, **{CONFIRM_ATTR: (None, None)})
        reported(world)
    assert stalled and set(world.agent.notified) == NOTIFIED
    counted = delta(before)
    if load_timeout == "0":
        assert counted == {"read_to_confirm": 1, "confirm_unanswered": 1}  # failed load
    else:
        assert counted.get("read_confirmed") == 1, counted  # the late yes reported it
        assert counted.pop("confirm_asked_again") >= 1  # each 0.5 s of the 1.2 s stall
        assert counted == {"read_to_confirm": 1, "read_confirmed": 1}


def test_the_worker_asks_as_long_as_the_load_may_take_and_once_without_a_load_bound(monkeypatch):
    for load_timeout, toggle, patience in (("30", "", 30.0), ("off", "", 0.0), ("0", "", 0.0),
                                           ("nonsense", "", 120.0), ("30", "off", 0.0)):
        monkeypatch.setenv("HOTFIX_LOAD_TIMEOUT_S", load_timeout)
        monkeypatch.setenv("HOTFIX_LOAD_BOUND", toggle)
        assert lease_guard.confirm_patience_s() == patience, (load_timeout, toggle)


def test_a_read_that_fails_on_its_own_is_reported_once_by_vllm(decode):
    with hotfix_active(FIX):
        world = decode()
        HELD.hold("prefill-R")
        before = counters()
        world.load("R", LOCAL, REMOTE, **{CONFIRM_ATTR: (None, None)})
        world.wait_for_handshake("R")
        world.start()
        first, second = world.worker._recving_transfers["R"]
        world.agent.finish(first)
        world.agent.finish(second, "ERR")
        recving, _, steps = reported(world)
        later = [world.finished()[0] for _ in range(5)]
    assert steps == 1 and not any("R" in r for r in later)
    assert len(world.worker.__dict__["_hotfix_lease_confirms"]) == 0
    assert delta(before) == {"read_to_confirm": 1}
