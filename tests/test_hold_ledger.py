"""The hold ledger on its own (no vLLM): the last holder frees, exactly once."""
from __future__ import annotations

from hotfix.fixes._holds import KEPT, LAST, NOT_HELD, PULL, RECV, SAVE, UNKNOWN, HoldLedger


def test_two_holders_free_once_in_either_order():
    for first, second in ((RECV, SAVE), (SAVE, RECV)):
        ledger = HoldLedger()
        ledger.hold("R", RECV)
        ledger.hold("R", SAVE)
        assert ledger.release("R", first) == KEPT
        assert ledger.holders("R") == (second,)
        assert ledger.release("R", second) == LAST


def test_a_release_by_a_party_that_holds_nothing_is_reported_not_counted():
    ledger = HoldLedger()
    ledger.hold("R", SAVE)
    assert ledger.release("R", RECV) == NOT_HELD
    assert ledger.holders("R") == (SAVE,)


def test_unknown_request_and_forget():
    ledger = HoldLedger()
    assert ledger.release("R", RECV) == UNKNOWN
    ledger.hold("R", PULL)
    ledger.forget("R")
    assert "R" not in ledger and len(ledger) == 0


def test_repeated_hold_by_one_party_needs_one_release():
    ledger = HoldLedger()
    ledger.hold("R", SAVE)
    ledger.hold("R", SAVE)
    assert ledger.release("R", SAVE) == LAST


def test_cap_evicts_oldest_and_reports_it():
    ledger = HoldLedger(cap=2)
    for req in ("A", "B", "C"):
        ledger.hold(req, SAVE)
    assert ledger.evicted == ["A"] and len(ledger) == 2


def test_ledger_is_empty_after_many_requests_come_and_go():
    ledger = HoldLedger()
    for i in range(10_000):
        ledger.hold(f"r{i}", RECV)
        ledger.hold(f"r{i}", SAVE)
        ledger.release(f"r{i}", SAVE)
        ledger.release(f"r{i}", RECV)
        ledger.forget(f"r{i}")
    assert len(ledger) == 0
