"""lease-guard's state and arithmetic on their own (no vLLM): the book of leases a decode
scheduler judges, the deadline values it accepts, the margin's variable, the NIXL answer
that carries several fixes' worker halves in one slot."""
from __future__ import annotations

import pytest

from hotfix import config
from hotfix.fixes._nixl_answer import NixlWorkerAnswer, answer_with
from hotfix.fixes.lease_guard import LeaseBook, parse_deadline


def test_a_lease_is_trusted_only_with_more_than_the_margin_left():
    book = LeaseBook(margin_s=5.0)
    book.arrive("early", 1000.0)
    book.arrive("edge", 1000.0)
    book.arrive("late", 1000.0)
    assert book.judge("early", 994.9) is None  # 5.1 s left: trusted
    assert book.judge("edge", 995.0) == pytest.approx(-5.0)  # 5 s left: inside the margin
    assert book.judge("late", 1012.5) == pytest.approx(12.5)
    assert len(book) == 2  # the refused ones wait for their READ


def test_a_lease_is_judged_once_when_first_relied_on():
    """Trusted at the first heartbeat: heartbeats renew it from then on, so a READ that
    leaves after the original deadline is not refused."""
    book = LeaseBook(margin_s=5.0)
    book.arrive("R", 1000.0)
    assert book.judge("R", 990.0) is None
    assert book.take_refusal("R", 1100.0) is None and len(book) == 0


def test_a_refusal_is_handed_out_once_with_the_read():
    book = LeaseBook(margin_s=0.0)
    book.arrive("R", 1000.0)
    assert book.judge("R", 1001.0) == pytest.approx(1.0)  # at the first heartbeat
    assert book.take_refusal("R", 1003.0) == pytest.approx(1.0)  # the READ leaves later
    assert book.take_refusal("R", 1004.0) is None and len(book) == 0


def test_a_request_that_finishes_before_its_read_leaves_the_book():
    book = LeaseBook(margin_s=5.0)
    book.arrive("waiting", 1000.0)
    book.arrive("refused", 1000.0)
    book.judge("refused", 2000.0)
    book.forget("waiting")
    book.forget("refused")
    assert len(book) == 0


def test_the_book_keeps_at_most_its_cap_and_drops_the_oldest_first():
    book = LeaseBook(margin_s=5.0, cap=3)
    evicted = sum(book.arrive(f"r{i}", 1000.0 + i) for i in range(5))
    assert evicted == 2 and len(book) == 3
    assert book.pending() == ["r2", "r3", "r4"]
    assert book.take_refusal("r0", 2000.0) is None  # dropped: stock behaviour for it


def test_a_request_id_arriving_again_is_judged_by_its_new_deadline():
    book = LeaseBook(margin_s=5.0)
    book.arrive("R", 1000.0)
    book.judge("R", 2000.0)
    book.arrive("R", 3000.0)
    assert book.take_refusal("R", 2000.0) is None and len(book) == 0


@pytest.mark.parametrize("raw, expected", [
    (1764600000.5, 1764600000.5), (1764600000, 1764600000.0),
    ("1764600000", None), (True, None), (None, None), (float("nan"), None),
    (float("inf"), None), (0, None), (-3.0, None), ([1.0], None),
])
def test_only_a_positive_finite_number_is_a_deadline(raw, expected):
    assert parse_deadline(raw) == expected


@pytest.mark.parametrize("raw, expected", [("", 5.0), ("2.5", 2.5), ("0", 0.0)])
def test_the_margin_variable_reads_seconds(monkeypatch, raw, expected):
    monkeypatch.setenv("HOTFIX_LEASE_GUARD_MARGIN_S", raw)
    assert config.seconds("HOTFIX_LEASE_GUARD_MARGIN_S", 5.0) == expected


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "inf"])
def test_a_bad_margin_is_one_error_and_the_default(monkeypatch, caplog, raw):
    monkeypatch.delenv("HOTFIX_STRICT", raising=False)
    monkeypatch.setenv("HOTFIX_LEASE_GUARD_MARGIN_S", raw)
    with caplog.at_level("ERROR", logger="vllm.hotfix"):
        assert config.seconds("HOTFIX_LEASE_GUARD_MARGIN_S", 5.0) == 5.0
    lines = [r.getMessage() for r in caplog.records if "HOTFIX_LEASE_GUARD_MARGIN_S" in r.getMessage()]
    assert len(lines) <= 1  # one line per bad value and process (an earlier test may have had it)
    monkeypatch.setenv("HOTFIX_STRICT", "1")
    with pytest.raises(config.ConfigError, match="HOTFIX_LEASE_GUARD_MARGIN_S"):
        config.seconds("HOTFIX_LEASE_GUARD_MARGIN_S", 5.0)


def test_two_fixes_announce_in_one_nixl_answer_next_to_pull_pins_confirmations():
    mine = answer_with(None, present={"lease-guard": frozenset({"t0"})})
    both = answer_with(mine, {"R": {"t0": 3}}, {"pull-pin": frozenset({"t0"})})
    assert isinstance(both, NixlWorkerAnswer) and both.confirmed == {"R": {"t0": 3}}
    assert both.hotfix_present == {"lease-guard": frozenset({"t0"}), "pull-pin": frozenset({"t0"})}
    other_rank = NixlWorkerAnswer(present={"lease-guard": frozenset({"t1"})})
    assert both.aggregate(other_rank).hotfix_present["lease-guard"] == frozenset({"t0", "t1"})
    assert answer_with(None) is None  # nothing to say: the slot stays stock (None)
    foreign = object()
    assert answer_with(foreign, present={"lease-guard": frozenset({"t0"})}) is foreign
