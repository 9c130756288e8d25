"""The halves' handshake on its own (no vLLM): stamps, announcements, the first output decides."""
from __future__ import annotations

import pickle

from hotfix import halves, status
from hotfix.halves import AGREED, DEGRADED, WAITING, SchedulerHalf, WorkerHalf


class Metadata:  # any vLLM metadata object: we only add an attribute of builtins
    pass


class Announcement:
    def __init__(self, present):
        self.hotfix_present = present


def _announce(*workers):
    present = {}
    for worker in workers:
        present = halves.merge_presence(present, Announcement(worker.presence()))
    return Announcement(present)


def test_every_rank_announcing_agrees_and_workers_stop_announcing():
    scheduler, ranks = SchedulerHalf("fix", ranks=2), [WorkerHalf("fix"), WorkerHalf("fix")]
    metadata = Metadata()
    scheduler.stamp(metadata)
    wire = pickle.loads(pickle.dumps(metadata))  # what a worker unpickles: builtins only
    for worker in ranks:
        worker.bound(wire)
        assert worker.state == WAITING and worker.may_ship
    scheduler.heard(_announce(*ranks))
    assert scheduler.state == AGREED
    metadata = Metadata()
    scheduler.stamp(metadata)
    for worker in ranks:
        worker.bound(metadata)
        assert worker.agreed and worker.presence() == {}


def test_a_rank_that_never_announces_degrades_the_engine_once():
    scheduler, patched = SchedulerHalf("fix-a", ranks=2), WorkerHalf("fix-a")
    metadata = Metadata()
    scheduler.stamp(metadata)
    patched.bound(metadata)
    scheduler.heard(_announce(patched))  # rank 1 is not patched: it announced nothing
    assert scheduler.state == DEGRADED and not scheduler.may_act
    assert "worker half missing" in status.degraded()["fix-a"]
    scheduler.heard(_announce(patched, WorkerHalf("fix-a")))
    assert scheduler.state == DEGRADED, "the decision is taken once"
    metadata = Metadata()
    scheduler.stamp(metadata)
    patched.bound(metadata)
    assert not patched.may_ship and patched.presence() == {}


def test_no_output_for_us_at_the_first_step_degrades():
    scheduler = SchedulerHalf("fix-b", ranks=1)
    assert scheduler.may_act  # provisional until the first output
    scheduler.heard(None)
    assert scheduler.state == DEGRADED


def test_a_worker_without_a_stamp_never_ships_and_degrades():
    worker = WorkerHalf("fix-c")
    worker.bound(Metadata())
    assert worker.state == DEGRADED and not worker.may_ship and worker.presence() == {}
    assert "scheduler half missing" in status.degraded()["fix-c"]


def test_stamps_of_two_fixes_share_one_attribute_and_count_epochs():
    a, b, metadata = SchedulerHalf("a", 1), SchedulerHalf("b", 1), Metadata()
    a.stamp(metadata)
    b.stamp(metadata)
    assert halves.stamp_of(metadata, "a") == (WAITING, 1)
    assert halves.stamp_of(metadata, "b") == (WAITING, 1)
    assert halves.stamp_of(metadata, "c") is None
    a.stamp(Metadata())
    assert a.epoch == 2


def test_a_scheduler_half_that_fails_gives_up_for_good():
    scheduler = SchedulerHalf("fix-d", ranks=1)
    scheduler.give_up("stamp failed: boom")
    assert not scheduler.may_act and "stamp failed" in status.degraded()["fix-d"]
    scheduler.heard(_announce(WorkerHalf("fix-d")))
    assert scheduler.state == DEGRADED


def test_an_error_fallback_degrades_an_existing_half_and_never_creates_or_raises():
    from types import SimpleNamespace

    from hotfix import halves

    owner = SimpleNamespace()
    halves.give_up(owner, "_half", "stamp failed")  # no half yet: nothing to degrade, no error
    halves.give_up(None, "_half", "stamp failed")
    assert vars(owner) == {}
    owner._half = halves.SchedulerHalf("demo-fix", 1)
    halves.give_up(owner, "_half", "stamp failed")
    assert owner._half.state == halves.DEGRADED


def test_an_external_launcher_engine_hears_its_own_rank_only():
    """vLLM's external_launcher runs a scheduler beside one worker in each process (no
    aggregation over the world): one announcing rank is the whole engine. Counting world_size
    ranks there logged a false degraded ERROR and left every fix stock."""
    from types import SimpleNamespace

    launched = SimpleNamespace(distributed_executor_backend="external_launcher", world_size=2)
    executor = SimpleNamespace(distributed_executor_backend="mp", world_size=2)
    for config, expected in ((launched, AGREED), (executor, DEGRADED)):
        scheduler, worker = SchedulerHalf.for_engine("fix", config), WorkerHalf("fix")
        metadata = Metadata()
        scheduler.stamp(metadata)
        worker.bound(pickle.loads(pickle.dumps(metadata)))
        scheduler.heard(_announce(worker))
        assert scheduler.state == expected
