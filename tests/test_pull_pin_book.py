"""pull-pin's bookkeeping on its own (no vLLM): confirmations per rank, aggregation."""
from __future__ import annotations

from hotfix.fixes.pull_pin import PinBook, ReadsConfirmed, _Pin


def test_a_pin_is_released_only_when_every_rank_confirmed():
    book = PinBook()
    book.add("R", _Pin(["b1", "b2"], expected=2))
    assert book.confirm("R", 1) is False and book.pinned("R")
    assert book.confirm("R", 1) is True and not book.pinned("R")
    assert [p.blocks for p in book.ready] == [["b1", "b2"]]


def test_confirmation_for_an_unpinned_request_is_ignored():
    book = PinBook()
    assert book.confirm("notify-only", 2) is False and book.ready == []


def test_two_reads_of_one_request_are_released_oldest_first():
    book = PinBook()
    book.add("R", _Pin(["old"], expected=1))
    book.add("R", _Pin(["new"], expected=1))
    book.confirm("R", 1)
    assert [p.blocks for p in book.ready] == [["old"]] and len(book) == 1


def test_worker_confirmations_sum_over_ranks():
    merged = ReadsConfirmed({"R": 1, "S": 1}).aggregate(ReadsConfirmed({"R": 1}))
    assert merged.counts == {"R": 2, "S": 1}
