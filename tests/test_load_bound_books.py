"""load-bound's state alone, without vLLM: the clock of loads in flight and the quarantine."""
from __future__ import annotations

from hotfix.fixes.load_bound import LoadClock, Quarantine


def test_loads_are_overdue_in_start_order_once_past_the_bound():
    clock = LoadClock(timeout=10.0)
    clock.start("A", now=0.0, label="nixl")
    clock.start("B", now=5.0, label="lmcache")
    assert clock.overdue(9.9) == []
    assert clock.overdue(12.0) == [("A", "nixl")] and "A" not in clock and "B" in clock
    assert clock.overdue(15.0) == [("B", "lmcache")] and len(clock) == 0


def test_a_load_that_ends_leaves_the_clock_and_a_restart_moves_it_to_the_back():
    clock = LoadClock(timeout=10.0)
    clock.start("A", now=0.0)
    clock.start("B", now=1.0)
    clock.end("A")
    clock.end("never-started")
    clock.start("A", now=2.0)  # a new episode (a retry) gets a new deadline
    assert clock.overdue(11.5) == [("B", "")] and clock.overdue(12.0) == [("A", "")]


def test_clock_over_its_cap_evicts_the_oldest_for_the_caller_to_log():
    clock = LoadClock(timeout=1.0, cap=2)
    for i, req in enumerate("ABC"):
        clock.start(req, now=float(i))
    assert clock.evicted == ["A"] and len(clock) == 2


class Block:
    def __init__(self, block_id):
        self.block_id = block_id


def test_quarantine_gives_each_block_back_once_at_the_late_report():
    q = Quarantine()
    first, second = [Block(1), Block(2)], [Block(3)]
    q.add("R", (first, []))
    assert "R" in q and q.blocks == 2 and q.timed_out_before("R")
    q.add("R", (second, [Block(4)]))  # the retry timed out while the first transfer runs
    assert q.blocks == 4 and len(q) == 1
    groups = q.ended("R")
    assert [b.block_id for b in groups[0]] == [1, 2, 3] and [b.block_id for b in groups[1]] == [4]
    assert q.ended("R") == () and len(q) == 0 and q.blocks == 0
    assert q.timed_out_before("R")  # remembered for the retry budget, within its own bound


def test_quarantine_remembers_timeouts_within_a_bound_and_never_frees_an_evicted_entry():
    q = Quarantine(cap=2, remember=3)
    for req in "ABCD":
        q.add(req, ([Block(ord(req))],))
    assert q.evicted == ["A", "B"] and len(q) == 2  # counted and logged by the caller
    assert not q.timed_out_before("A") and q.timed_out_before("D")
