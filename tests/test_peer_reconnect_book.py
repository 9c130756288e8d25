"""peer-reconnect's state on its own (no vLLM): the prefills a decode worker must release
after a remote disconnect, bounded, and empty again once each was released."""
from __future__ import annotations

from hotfix.fixes.peer_reconnect import DisconnectedPrefills


def test_a_prefill_still_in_use_waits_and_each_leaves_the_book_once_released():
    book = DisconnectedPrefills()
    assert book.note("P1") is None and book.note("P2") is None and book.note("P1") is None
    assert len(book) == 2  # one mark per prefill, however many of its READs failed
    assert book.releasable(busy={"P1"}) == ["P2"]  # P1 still has a READ in flight
    assert book.releasable(busy={"P1"}) == []
    assert book.releasable(busy=set()) == ["P1"]
    assert len(book) == 0  # nothing held once released


def test_past_its_cap_the_book_drops_the_oldest_for_the_caller_to_log():
    book = DisconnectedPrefills(cap=2)
    book.note("P1")
    book.note("P2")
    book.note("P1")  # failed again: now the newest
    assert book.note("P3") == "P2"
    assert len(book) == 2 and book.releasable(busy=set()) == ["P1", "P3"]
