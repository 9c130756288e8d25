"""The fault table's after-READ row (issue #28): prefill and decode on two network hosts, the
hotfix on both engines (a stock prefill for the stock decode, a hotfix prefill for the hotfix
decode, ``FaultsWorld(hotfix_prefill=True)``).

Each decode READs its request and answers, and is SIGKILLed before the router hears; P got
NIXL's completion notification and freed the blocks, and fills them with other prompts; the
router retries the same request (the same ``kv_transfer_params``) on a new decode in the dead
one's place. Stock READs the reused blocks and answers wrong tokens without an error (the red,
asserted; P only logs "Potentially invalid KV blocks"). The hotfix decode READs too (the lease
has time left: P freed the blocks early, on the notification), then asks P, which answers "not
held": the load fails and is recomputed (or the READ, sharing the link with stock's, passes the
load bound first and is recomputed, and P's "not held" comes after). The killed decode's own
request is lost either way: a fault that kills the decode's process is beyond any fix in it.

CI proves the confirmation's red and green with real NIXL on one host (``test_pd_world.py``'s
lease lapsing during the READ) and in vLLM's real NIXL scheduler, worker and listener
(``test_lease_confirm_world.py``); this is the two-host run with a router's retry (~4 min here).
"""
from __future__ import annotations

import pytest

from conftest import faults_world
from hotfix.worlds.faults import AFTER_READ, faults

BOUND_S, SLACK_S = 15.0, 30.0  # as the CI faults test
CLAIMED_IN_CI = ("test_pd_world.py::test_hotfix_fails_a_read_the_prefill_does_not_confirm_and_recomputes_it, "
                 "test_lease_confirm_world.py")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with faults_world(tmp_path_factory, "faults-retry", BOUND_S, SLACK_S, hotfix_prefill=True) as world:
        yield world


@pytest.mark.beyond_ci_budget(CLAIMED_IN_CI)
def test_a_retry_after_the_first_decode_read_and_died_is_garbage_on_stock_and_recomputed_with_the_hotfix(world):
    stock, hotfix = world.run(faults(BOUND_S, SLACK_S)["decode_killed_retried", AFTER_READ])
    print(f"\ndecode_killed_retried after-READ:\n  stock {stock}\n  hotfix {hotfix}")

    assert (stock.wrong_tokens, stock.answer, stock.nixl_failures) == (1, "tokens", []), stock
    assert (hotfix.engine_deaths, hotfix.wrong_tokens, hotfix.not_terminal, hotfix.leaked_blocks) \
        == (0, 0, 0, 0), hotfix
    assert hotfix.answer == "recomputed" and hotfix.recover_s < BOUND_S + SLACK_S, hotfix
    assert hotfix.lease_guard.get("read_unconfirmed", 0) >= 1, hotfix.lease_guard  # P said "not held"
    assert hotfix.next_read_ok and stock.next_read_ok, (stock, hotfix)
    assert "AssertionError" not in world.decodes["hotfix"].log()
