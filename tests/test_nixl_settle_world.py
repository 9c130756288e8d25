"""nixl-settle (D7) against vLLM's real NIXL decode worker (only the NIXL agent is a double).

A pull from a prefill with TP=2 into a decode with TP=1 is two READ handles. When one remote
fails while the other handle still runs, stock 0.27-0.29 reports R early and then trips
``assert meta is not None`` in its own worker when the other handle ends: red, asserted.
With the fix R is reported once, after its last handle, as failed. On 0.30+ the same timeline
reports once on stock vLLM (the upstream fix), and the hotfix stays off there.
"""
from __future__ import annotations

import traceback

import pytest

from hotfix import registry, status
from hotfix.fixes import nixl_settle
from hotfix.worlds.hotfix_on import hotfix_active

FIX = "nixl-settle"
WORKER_ASSERT = 'assert meta is not None, f"{req_id} not found in recving_metadata list"'

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
from hotfix.worlds.nixl_worker import DecodeWorld  # noqa: E402  (needs vLLM's NIXL package)


def _shape() -> str:
    """What the fix decides on the installed vLLM: known_shape (0.27-0.29), fixed_upstream (0.30+)."""
    return registry.decide(nixl_settle.SPEC, mode="on").reason


AFFECTED = _shape() == "known_shape"
pre_030 = pytest.mark.skipif(not AFFECTED, reason="vLLM 0.30+ holds failures itself (fixed upstream)")


@pytest.fixture
def world(monkeypatch):
    from vllm.platforms import current_platform

    if not current_platform.device_type:  # a --no-deps vLLM (the 0.33.0 leg): no platform
        pytest.skip("NIXL's worker needs a vLLM platform with a device type")
    worlds = []

    def build(**kwargs):
        w = DecodeWorld(monkeypatch, **kwargs)
        worlds.append(w)
        return w

    yield build
    for w in worlds:
        w.close()


def pull(world, req_id="R", **kwargs):
    """R's pull started: handshake with both prefill ranks, the READ split in two handles."""
    w = world(**kwargs)
    w.load(req_id, [1, 2], [5, 6])
    w.wait_for_handshake(req_id)
    w.start()
    return w


def steps(w, events):
    """Run worker steps; ``events[i]`` (a callable) runs before step i. Returns what each
    step reported (recv ids, invalid blocks) and the crash, if the worker raised."""
    seen = []
    for event in events:
        event()
        try:
            seen.append(w.finished())
        except AssertionError as exc:
            return seen, exc
    return seen, None


def crash_line(exc) -> str:
    return traceback.extract_tb(exc.__traceback__)[-1].line


def failed_handle_timeline(w):
    rank0, rank1 = (w.agent.handles_to(w.prefill_agent(r))[0] for r in (0, 1))
    return [lambda: w.agent.finish(rank0, "ERR"), lambda: None, lambda: w.agent.finish(rank1), lambda: None]


def failed_setup_timeline(w):
    (rank0,) = w.agent.handles_to(w.prefill_agent(0))
    return [lambda: None, lambda: w.agent.finish(rank0), lambda: None]


@pre_030
def test_one_failed_handle_of_a_split_read_reports_once_after_the_last_handle(world):
    stock = pull(world)
    assert len(stock.worker._recving_transfers["R"]) == 2  # one READ per prefill rank
    seen, crash = steps(stock, failed_handle_timeline(stock))
    assert seen[0] == ({"R"}, {1, 2})  # reported at the failure, rank 1's READ still running
    assert crash is not None and crash_line(crash) == WORKER_ASSERT  # the worker dies

    with hotfix_active(FIX) as act:
        assert act.snapshot()[FIX]["state"] == "applied"
        before = dict(status.counters().get(FIX, {}))
        fixed = pull(world)
        seen, crash = steps(fixed, failed_handle_timeline(fixed))
    assert crash is None, traceback.format_exception(crash)
    # the failed blocks are reported at the failure; R itself once, when rank 1 ended
    assert seen == [(set(), {1, 2}), (set(), set()), ({"R"}, set()), (set(), set())]
    assert fixed.worker._recving_metadata == {} and not fixed.worker._recving_transfers
    assert fixed.worker.__dict__["_hotfix_settle"] == set()  # nothing held at idle
    assert fixed.agent.states == {} and fixed.agent.misuse == []  # every handle released once
    after = status.counters()[FIX]
    assert {k: after[k] - before.get(k, 0) for k in ("held", "settled")} == {"held": 1, "settled": 1}


@pre_030
def test_a_read_that_could_not_be_set_up_to_one_rank_reports_once_after_the_other(world):
    stock = world()
    stock.agent.fail_setup_to(stock.prefill_agent(1))
    _start(stock)
    seen, crash = steps(stock, failed_setup_timeline(stock))
    assert seen[0] == ({"R"}, {1, 2}) and crash_line(crash) == WORKER_ASSERT

    with hotfix_active(FIX):
        fixed = world()
        fixed.agent.fail_setup_to(fixed.prefill_agent(1))
        _start(fixed)
        seen, crash = steps(fixed, failed_setup_timeline(fixed))
    assert crash is None, traceback.format_exception(crash)
    assert seen == [(set(), {1, 2}), ({"R"}, set()), (set(), set())]
    assert fixed.worker._recving_metadata == {} and fixed.agent.states == {}


def _start(w, req_id="R"):
    w.load(req_id, [1, 2], [5, 6])
    w.wait_for_handshake(req_id)
    w.start()


@pre_030
def test_every_handle_failing_or_ending_together_is_one_report_as_on_stock(world):
    """What stock already gets right stays as it is: both handles end in one poll."""
    def both(w, states):
        handles = [w.agent.handles_to(w.prefill_agent(r))[0] for r in (0, 1)]
        return [lambda: [w.agent.finish(h, s) for h, s in zip(handles, states)], lambda: None]

    for states in (("ERR", "ERR"), ("DONE", "ERR"), ("DONE", "DONE")):
        stock = pull(world)
        expected = steps(stock, both(stock, states))
        with hotfix_active(FIX):
            fixed = pull(world)
            got = steps(fixed, both(fixed, states))
        assert got == expected and got[1] is None and got[0][0][0] == {"R"}, states


def test_a_failed_handshake_is_reported_once_on_stock_so_it_is_not_d7(world):
    """The handshake fails before any READ handle exists: nothing is left to report R again."""
    w = world(bad_handshake_ranks=(1,))
    w.load("R", [1, 2], [5, 6])
    w.wait_for_handshake("R")
    w.start()
    assert not w.worker._recving_transfers.get("R")
    seen, crash = steps(w, [lambda: None, lambda: None])
    assert crash is None
    assert [recv for recv, _ in seen] == [{"R"}, set()]


@pre_030
def test_toggled_off_is_stock(world, monkeypatch):
    monkeypatch.setenv("HOTFIX_NIXL_SETTLE", "off")
    with hotfix_active(FIX) as act:
        assert act.snapshot()[FIX] == {"state": "skipped", "reason": "disabled", "wrapped": []}
        w = pull(world)
        _, crash = steps(w, failed_handle_timeline(w))
    assert crash_line(crash) == WORKER_ASSERT


@pytest.mark.skipif(AFFECTED, reason="vLLM 0.27-0.29: the defect is there (tests above)")
def test_on_030_and_later_stock_reports_a_partial_failure_once_and_the_fix_stays_off(world):
    assert _shape() == "fixed_upstream"
    with hotfix_active(FIX) as act:
        assert act.snapshot()[FIX]["state"] == "skipped"
    w = pull(world)
    seen, crash = steps(w, failed_handle_timeline(w))
    assert crash is None
    assert [recv for recv, _ in seen] == [set(), set(), {"R"}, set()]
