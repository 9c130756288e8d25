"""The per-process status file keeps up with counters and gauges without the hot path ever
writing it: a one-shot timer writes what changed at most once an interval, even if nothing
else happens (an idle engine); the exit writes the last record, marked exited."""
from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from hotfix import status


@pytest.fixture
def status_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTFIX_STATUS_DIR", str(tmp_path))
    monkeypatch.setattr(status, "FLUSH_INTERVAL_S", 0.3)
    act = SimpleNamespace(source="test", snapshot=lambda: {})
    monkeypatch.setattr(status, "_activation_of_this_process", lambda: act)
    status._flush_scheduled = False  # a timer of an earlier test may be pending
    monkeypatch.setattr(status, "_exited_at", None)
    # this process's own maps: earlier tests may have filled the counters to MAX_KEYS
    monkeypatch.setattr(status, "_counters", Counter())
    monkeypatch.setattr(status, "_gauges", {})
    return tmp_path / f"{os.getpid()}.json"


def read(path) -> dict:
    return json.loads(path.read_text())


def wait_for(predicate, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "the status file never caught up"
        time.sleep(0.02)


def test_counts_reach_the_file_by_a_timer_never_by_the_caller(status_file, monkeypatch):
    writers = []
    real_write = status.write
    monkeypatch.setattr(status, "write", lambda act: (writers.append(threading.current_thread()),
                                                      real_write(act)))
    before = 0
    for _ in range(1000):
        status.count("flush-test", "seen")
    assert threading.current_thread() not in writers
    wait_for(lambda: status_file.exists()
             and read(status_file)["counters"].get("flush-test", {}).get("seen") == before + 1000)
    assert len(writers) <= 2  # one timer per interval, for any number of counts
    assert threading.current_thread() not in writers


def test_a_gauge_is_written_when_it_changes_and_its_last_value_stays(status_file):
    status.gauge("flush-test", "held_now", 7)
    wait_for(lambda: status_file.exists() and read(status_file)["gauges"]["flush-test"]["held_now"] == 7)
    status.gauge("flush-test", "held_now", 0)
    wait_for(lambda: read(status_file)["gauges"]["flush-test"]["held_now"] == 0)


def test_the_exit_writes_a_last_record_marked_exited(status_file):
    status.count("flush-test", "at-exit")
    status._on_exit()
    last = read(status_file)
    assert last["exited_at"] and last["counters"]["flush-test"]["at-exit"] >= 1
    assert not status.is_live(last)
    assert status.is_live({**last, "exited_at": None})


def test_identity_fields_are_in_the_record(status_file):
    status.identify(kind="worker", model_name="m", engine="0", rank=1)
    wait_for(lambda: status_file.exists() and read(status_file).get("rank") == 1)
    record = read(status_file)
    assert (record["model_name"], record["engine"], record["identity"]["kind"]) == ("m", "0", "worker")
    assert record["ppid"] == os.getppid() and record["instance"]


def _count_and_return() -> None:
    status.count("flush-test", "in-child")


def test_a_forked_multiprocessing_child_writes_its_own_exit_record(status_file):
    """A fork child ends with os._exit (no atexit): its exit record comes from multiprocessing's
    finalizers, and it starts without the parent's counts."""
    import multiprocessing

    status.count("flush-test", "in-parent")
    child = multiprocessing.get_context("fork").Process(target=_count_and_return)
    child.start()
    child.join(30)
    record = read(status_file.parent / f"{child.pid}.json")
    assert record["exited_at"] and record["counters"] == {"flush-test": {"in-child": 1}}


def test_a_timer_record_taken_before_a_degrade_never_replaces_the_degraded_one(status_file, monkeypatch):
    """The timer took its record, then a half degraded and wrote its own; the timer's, older,
    must not land last (the file said applied for a fix running stock, until the next write)."""
    act = SimpleNamespace(source="test", snapshot=lambda: {"pull-pin": {"state": "applied", "reason": ""}})
    monkeypatch.setattr(status, "_activation_of_this_process", lambda: act)
    monkeypatch.setattr(status, "_degraded", {})
    real, taken, go = status.snapshot, threading.Event(), threading.Event()

    def slow_first(activation):
        record = real(activation)
        if threading.current_thread().name == "timer":
            taken.set()
            go.wait(5)
        return record

    monkeypatch.setattr(status, "snapshot", slow_first)
    timer = threading.Thread(target=status.write, args=(act,), name="timer")
    timer.start()
    assert taken.wait(5)
    status.degrade("pull-pin", "worker half missing: test")  # writes the degraded record
    assert read(status_file)["fixes"]["pull-pin"]["state"] == "degraded"
    go.set()
    timer.join(5)
    assert read(status_file)["fixes"]["pull-pin"]["state"] == "degraded"
    assert not list(status_file.parent.glob("*.tmp"))
