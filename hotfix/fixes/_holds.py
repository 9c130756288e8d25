"""The hold ledger: who still holds a finished request's blocks (D4).

vLLM keeps one boolean per request ("delay the free"), set by the scheduler's recv hold (an
abort while ``WAITING_FOR_REMOTE_KVS``) *or* a connector's async-save hold, and frees on the
first completion of either kind: the blocks go back to the pool under the other party's
transfer. The ledger names every party; the blocks are freed once, by the last release.
No timer ever releases a hold. Shared by xfer-guard and pull-pin (so either works alone).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Set, Tuple

from hotfix.runtime import state_of

RECV = "recv"  # the scheduler waits for finished_recving (abort while WAITING_FOR_REMOTE_KVS)
SAVE = "save"  # the connector (MultiConnector: all its savers) owes one finished_sending
PULL = "pull"  # pull-pin: a NIXL READ into the blocks may still run

# Results of HoldLedger.release
LAST, KEPT, NOT_HELD, UNKNOWN = "last", "kept", "not_held", "unknown"


class HoldLedger:
    """Per-request sets of holding parties, bounded; one per scheduler.

    Lifecycle: ``hold`` when vLLM delays a free, ``release`` on each party's terminal
    report (``LAST`` means: let vLLM free now), ``forget`` when vLLM frees the request's
    blocks, whichever path did it. An entry therefore never outlives the blocks it guards.
    """

    def __init__(self, cap: int = 65536) -> None:
        self.cap = cap
        self._holds: "OrderedDict[str, Set[str]]" = OrderedDict()
        self.evicted: list = []

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._holds

    def holders(self, req_id: str) -> Tuple[str, ...]:
        return tuple(sorted(self._holds.get(req_id, ())))

    def hold(self, req_id: str, party: str) -> None:
        self._holds.setdefault(req_id, set()).add(party)
        while len(self._holds) > self.cap:
            self.evicted.append(self._holds.popitem(last=False)[0])

    def release(self, req_id: str, party: str) -> str:
        holders = self._holds.get(req_id)
        if holders is None:
            return UNKNOWN
        if party not in holders:
            return NOT_HELD
        holders.discard(party)
        return KEPT if holders else LAST

    def forget(self, req_id: str) -> None:
        self._holds.pop(req_id, None)


def ledger_of(scheduler) -> HoldLedger:
    """The ledger of one Scheduler instance (created on first use)."""
    return state_of(scheduler, "_hotfix_holds", HoldLedger)
