"""The fault table's late delivery under clock skew (issue #28): prefill and decode on two
network hosts whose monotonic clocks differ (the prefill host in a time namespace of its own,
``two_hosts``: another boot time, what ``time.perf_counter`` sees on two real hosts), the
prefills with the hotfix leasing blocks for ``LEASE_S``.

The router holds a request until the prefill's lease ran out and the prefill reused its blocks
(``router_late``), then hands it to a stock and a hotfix decode. The hotfix decode does not ask
the prefill (``confirm=False``): it judges the lease by its deadline on P's clock, the path a
clock offset could fool. P 60 s ahead: a decode comparing raw clocks would read the expired
lease as 60 s fresh (garbage); P 60 s behind: it would refuse every timely READ. Neither
happens: the hotfix refuses the late one (recomputed, P's tokens) and READs the timely next
one; stock answers the late one with wrong tokens and no error (the red, asserted).

CI proves the same judgement in-process
(``test_lease_guard_world.py::test_a_lease_is_judged_on_the_prefills_clock_whatever_the_hosts_wall_clocks_say``)
and the late READ's red and green with real NIXL on one host (``test_pd_world.py``'s lapsed
lease); this is the two-host run, two worlds of four engines (~6 min here).
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import faults_world
from hotfix.worlds.faults import BEFORE_READ, lease_faults
from hotfix.worlds.two_hosts import NoNetworkNamespaces, TwoHosts, _check_clock_offset

BOUND_S, SLACK_S = 15.0, 30.0  # as the CI faults test: the hotfix decode's load bound, its slack
LEASE_S = 20  # the prefills' kv_lease_duration: the router's hold outlives it
CLAIMED_IN_CI = ("test_lease_guard_world.py::test_a_lease_is_judged_on_the_prefills_clock_whatever_the_hosts_"
                 "wall_clocks_say, test_pd_world.py's lapsed lease")


@pytest.fixture(scope="module", params=[60, -60], ids=lambda s: f"prefill-clock{s:+d}s")
def world(request, tmp_path_factory):
    with faults_world(tmp_path_factory, "faults-clock", BOUND_S, SLACK_S, hotfix_prefill=True, lease_s=LEASE_S,
                      prefill_clock_offset_s=request.param, confirm=False) as world:
        yield world


@pytest.mark.beyond_ci_budget(CLAIMED_IN_CI)
def test_a_late_delivery_is_garbage_on_stock_and_refused_by_its_deadline_on_the_prefills_clock(world):
    stock, hotfix = world.run(lease_faults(LEASE_S)["router_late", BEFORE_READ])
    print(f"\nrouter_late, prefill clock {world.prefill_clock_offset_s:+d} s:\n  stock {stock}\n  hotfix {hotfix}")

    # the red: P reused the blocks, stock READ them and answered from them without an error
    assert (stock.wrong_tokens, stock.answer, stock.nixl_failures) == (1, "tokens", []), stock
    # the lease was refused by its deadline before the READ left (not a failed or timed-out READ)
    assert (hotfix.engine_deaths, hotfix.wrong_tokens, hotfix.not_terminal, hotfix.leaked_blocks) \
        == (0, 0, 0, 0), hotfix
    assert hotfix.answer == "recomputed" and not hotfix.nixl_failures, hotfix
    assert hotfix.lease_guard.get("lease_expired_refused", 0) >= 1, hotfix.lease_guard
    assert hotfix.recover_s < BOUND_S, hotfix
    # a timely request, right after, is READ across the link, not refused
    assert hotfix.next_read_ok and stock.next_read_ok, (stock, hotfix)
    assert "AssertionError" not in world.decodes["hotfix"].log()


def test_a_prefill_host_whose_clock_offset_did_not_apply_is_refused():
    """The two hosts read the prefill host's clock through its own command: an offset that took
    effect is accepted; a host that claims one its processes do not see (no time namespace)
    is refused, so a world cannot say +60 s and run on one clock."""
    try:
        hosts = TwoHosts(60)
    except NoNetworkNamespaces as exc:
        pytest.skip(f"two hosts with offset clocks need network and time namespaces: {exc}")
    with hosts:
        _check_clock_offset(hosts.prefill)  # the real one: +60 s
        unapplied = replace(hosts.prefill, clock_offset_s=0)
        claimed = replace(hosts.prefill, clock_offset_s=60)
        with pytest.raises(NoNetworkNamespaces, match="not \\+60 s"):
            _check_clock_offset(_Claiming(claimed, unapplied))


class _Claiming:
    """A host that says ``claimed``'s offset but runs commands as ``runs`` (no namespace)."""

    def __init__(self, claimed, runs) -> None:
        self.clock_offset_s, self.command = claimed.clock_offset_s, runs.command
