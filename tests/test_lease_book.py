"""lease-guard's state and arithmetic on their own (no vLLM): the book of leases a decode
scheduler judges, the prefill clocks it judges them on, what a worker rank reports of those
clocks, the deadline values it accepts, the margin's variable, the NIXL answer that carries
several fixes' worker halves in one slot."""
from __future__ import annotations

import pytest

from hotfix import config
from hotfix.fixes._nixl_answer import NixlWorkerAnswer, answer_with
from hotfix.fixes.lease_guard import ClockReport, LeaseBook, PrefillClocks, parse_deadline


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


def test_a_lease_on_the_prefills_clock_is_judged_only_where_that_clock_is_known():
    """P's clock is its own perf_counter (another host: another epoch); D's wall clock says
    nothing about it, however far the two hosts' wall clocks are apart."""
    book = LeaseBook(margin_s=5.0)
    book.arrive("R", deadline=1000.0, expiry=50_020.0)  # P's clock: 20 s left at 50,000
    assert book.judge("R", now=1026.0) is None and book.pending() == ["R"]  # not decidable here
    assert book.judge("R", now=1026.0, prefill_now=50_000.0) is None and len(book) == 0  # trusted
    book.arrive("L", deadline=1000.0, expiry=50_020.0)
    assert book.take_refusal("L", now=986.0, prefill_now=50_028.0) == pytest.approx(8.0)


def test_a_lease_the_scheduler_cannot_judge_is_handed_to_the_worker_once():
    book = LeaseBook(margin_s=5.0)
    book.arrive("R", deadline=1000.0, expiry=50_020.0)
    assert book.take_refusal("R", now=990.0) is None
    assert book.hand_over("R") == (1000.0, 50_020.0)
    assert book.hand_over("R") is None and len(book) == 0


def test_a_prefill_clock_is_known_once_every_rank_reported_it_and_the_largest_offset_counts():
    clocks = PrefillClocks(ranks=2)
    clocks.heard({"rank-a": {"P": 100.0}})
    assert clocks.now_on("P", 10.0) is None  # rank b has no handshake with P: no heartbeat leaves
    clocks.heard({"rank-b": {"P": 100.5, "Q": 3.0}})
    assert clocks.now_on("P", 10.0) == pytest.approx(110.5)
    assert clocks.now_on("Q", 10.0) is None
    clocks.heard({"rank-a": {}})  # rank a's handshake with P was evicted
    assert clocks.now_on("P", 10.0) is None


def test_the_clocks_keep_at_most_their_cap_of_ranks():
    clocks = PrefillClocks(ranks=1, cap=3)
    for i in range(10):
        clocks.heard({f"rank-{i}": {"P": float(i)}})
    assert len(clocks) == 3 and clocks.now_on("P", 0.0) == pytest.approx(9.0)


def test_a_worker_reports_its_prefill_clocks_only_when_they_change():
    report = ClockReport(tolerance_s=0.05)
    assert report.changed({}, 0.0) is None  # nothing known, nothing said
    assert report.changed({"P": 12.0}, 0.0) == {"P": 12.0}  # a handshake completed
    assert report.changed({"P": 12.01}, 0.0) is None  # noise
    assert report.changed({"P": 12.2}, 0.0) == {"P": 12.2}
    assert report.changed({}, 0.0) == {}  # evicted: the EngineCore must hear it


def test_a_worker_on_another_host_than_its_enginecore_adds_the_least_gap_seen():
    """Offsets are measured against the worker's clock; the EngineCore judges on its own.
    The least gap between a step's scheduler_clock and the worker reading it is the clocks'
    difference plus the shortest delivery: a larger offset, the safe side."""
    import time

    report = ClockReport()
    ahead = time.perf_counter() - 1000.0  # the EngineCore's clock, 1000 s behind this worker's
    (offset,) = report.changed({"P": 5.0}, ahead).values()
    assert offset == pytest.approx(1005.0, abs=0.5)


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
