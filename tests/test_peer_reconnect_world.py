"""peer-reconnect (D12) against vLLM's real NIXL decode worker (only the NIXL agent is a double,
which loses its prefill the way NIXL 1.5.1 does: ``benchmarks/nixl_post.py`` measured it).

The prefill host is lost mid-READ (both prefill ranks' agents disconnected): R's READ fails.
The network comes back. On stock vLLM the next request to that prefill fails too, at setup,
with the same error: the worker keeps the dead agents (the red, asserted), and so would every
later one until a restart. With the fix the worker releases that prefill's NIXL state before
its next step's loads, the next request handshakes again and its READ runs.
"""
from __future__ import annotations

import pytest

from hotfix import status
from hotfix.worlds.hotfix_on import hotfix_active

FIX = "peer-reconnect"

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
from hotfix.worlds.nixl_worker import PREFILL, PREFILL_TP  # noqa: E402


@pytest.fixture
def world(decode_worlds):
    return decode_worlds


def lose_the_prefill_mid_read(w) -> None:
    """R's READ (one handle per prefill rank) is under way when UCX loses the prefill host."""
    w.load("R", [1, 2], [5, 6])
    w.wait_for_handshake("R")
    w.start()
    assert len(w.agent.states) == PREFILL_TP
    for rank in range(PREFILL_TP):
        w.agent.disconnect(w.prefill_agent(rank))
    recving, invalid = w.finished()
    assert invalid == {1, 2}, (recving, invalid)  # R failed: its blocks are reported invalid


def next_request(w) -> tuple[set, set]:
    """The next request to the same prefill, once the network is back: its step, its
    handshake if one starts, and the report of the step after."""
    w.load("S", [3, 4], [7, 8])
    if w.worker._handshake_futures:
        w.wait_for_handshake("S")
        w.start()
    for handle in [h for h, state in w.agent.states.items() if state == "PROC"]:
        w.agent.finish(handle)
    return w.finished()


def test_a_prefill_lost_mid_read_is_handshaken_again_for_the_next_request(world):
    stock = world()
    lose_the_prefill_mid_read(stock)
    recving, invalid = next_request(stock)
    assert invalid == {3, 4}, (recving, invalid)  # the red: S fails at setup, as every later one would
    assert not stock.agent.removed and PREFILL in stock.worker._remote_agents  # the dead agents kept

    with hotfix_active(FIX) as act:
        assert act.snapshot()[FIX]["state"] == "applied"
        before = dict(status.counters().get(FIX, {}))
        fixed = world()
        lose_the_prefill_mid_read(fixed)
        recving, invalid = next_request(fixed)
    assert (recving, invalid) == ({"S"}, set())  # S READ from the prefill, handshaken again
    assert sorted(fixed.agent.removed) == [fixed.prefill_agent(r) for r in range(PREFILL_TP)]
    assert fixed.agent.misuse == [] and fixed.agent.states == {}
    assert len(fixed.worker.__dict__["_hotfix_disconnected"]) == 0  # nothing held at idle
    after = status.counters()[FIX]
    assert after.get("released", 0) - before.get("released", 0) == 1


def test_a_prefill_is_released_only_once_no_read_of_it_is_in_flight(world):
    """UCX loses prefill rank 0 first: R's READ fails there while its READ from rank 1 is
    still in flight, which needs the prefill's NIXL state: released once that one ended."""
    with hotfix_active(FIX, "nixl-settle"):  # (one handle failing before the other: D7 on 0.27-0.29)
        w = world()
        w.load("R", [1, 2], [5, 6])
        w.wait_for_handshake("R")
        w.start()
        w.agent.disconnect(w.prefill_agent(0))
        w.finished()  # rank 0's READ failed
        w.start()
        assert PREFILL in w.worker._remote_agents and not w.agent.removed  # rank 1's READ runs
        (rank1,) = w.agent.handles_to(w.prefill_agent(1))
        w.agent.finish(rank1)
        w.finished()
        w.start()
    assert PREFILL not in w.worker._remote_agents
    assert sorted(w.agent.removed) == [w.prefill_agent(r) for r in range(PREFILL_TP)]
