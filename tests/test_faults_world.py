"""The fault table's bounded variant (issue #28): prefill and decode on two network hosts,
NIXL/UCX over TCP across a shaped veth link (``two_hosts``), a stock and a hotfix decode hit
by the same fault. The whole table, with its other faults and phases, is
``benchmarks/faults.py``.

Here: the prefill host hangs (SIGSTOP) after its prefill handed its params over and before the
decodes READ (SIGCONT past the bound and its slack). P's kernel keeps its sockets open, so nothing times out:
the stock request waits for as long as P is stopped (the red, asserted), while the hotfix's
answers P's tokens at the bound (``recompute``), then absorbs the late report when P resumes,
gets every block back and serves the next request across the link right.
"""
from __future__ import annotations

import pytest

from conftest import faults_world, settled_status
from hotfix.worlds.faults import BEFORE_READ, faults

BOUND_S = 15.0  # HOTFIX_LOAD_TIMEOUT_S of the hotfix decode; a warm READ here takes seconds
# The engine notices the bound at its next step, and a step can take seconds on a 2-core box:
# vLLM's worker re-reads the EngineCore's ring buffer only every 5 s after a lost wake-up
# (py-spy: EngineCore and worker both waiting to read; 4-12 s steps while P was stopped, 1 in
# ~4 runs of the loopback world; the faults world now bounds that re-read to 1 s, pd_world's
# WORKER_RECHECK_VAR); recompute then prefills and decodes on a loaded box.
SLACK_S = 30.0


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with faults_world(tmp_path_factory, "faults", BOUND_S, SLACK_S) as world:
        yield world


def test_a_prefill_host_hung_before_the_read_wedges_stock_and_the_hotfix_answers_at_the_bound(world):
    before = settled_status(world.load_bound_counts)
    stock, hotfix = world.run(faults(BOUND_S, SLACK_S)["prefill_hung", BEFORE_READ])
    print(f"\nprefill_hung before-READ: stock {stock}\n                          hotfix {hotfix}")

    # the red: nothing of stock's bounds the wait; only UCX's own peer timeout can end it (a
    # failed READ, then recompute), and it did in some runs here
    assert stock.not_terminal == 1 or (stock.answer == "recomputed" and stock.nixl_failures), stock
    assert (stock.engine_deaths, stock.wrong_tokens, stock.leaked_blocks) == (0, 0, 0), stock
    assert (hotfix.engine_deaths, hotfix.wrong_tokens, hotfix.not_terminal, hotfix.leaked_blocks) \
        == (0, 0, 0, 0), hotfix
    assert hotfix.recover_s < BOUND_S + SLACK_S and hotfix.answer == "recomputed", hotfix
    if not hotfix.nixl_failures:  # the bound ended it, not UCX: one timeout, its late report came
        want = {kind: n + 1 for kind, n in before.items()}
        assert BOUND_S <= hotfix.recover_s, hotfix
        assert settled_status(world.load_bound_counts, lambda now: now == want) == want
    assert "AssertionError" not in world.decodes["hotfix"].log()
    assert hotfix.next_read_ok and stock.next_read_ok, (stock, hotfix)
