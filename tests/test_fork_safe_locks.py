"""Every lock of the hotfix is free in a forked child, whatever a parent thread held at the fork.

vLLM forks EngineCores and workers while our threads run (the status timer, hooks on NIXL or
ZMQ threads). A thread hammers one lock (holding it nearly all the time) while the main thread
forks; each child must take that lock at once. The control: a plain lock, the pattern every
one of ours had, hangs the children (the hazard the test would miss if it could not fail).
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import hotfix
from hotfix import _deps, config, log, metrics, registry, status

FORKS = 5


def forked_children_that_hang(get_lock, in_child=None) -> int:
    """Fork while a thread holds ``get_lock()``; children that cannot take it within 2 s."""
    stop = threading.Event()
    held = threading.Event()

    def hammer():
        while not stop.is_set():
            with get_lock():
                held.set()
                time.sleep(0.005)

    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    hung = 0
    try:
        for _ in range(FORKS):
            held.wait(5)
            pid = os.fork()
            if pid == 0:  # the child: take the lock (or do what takes it), then leave at once
                signal.alarm(2)
                try:
                    if in_child:
                        in_child()
                    else:
                        with get_lock():
                            pass
                finally:
                    os._exit(0)
            _, code = os.waitpid(pid, 0)
            hung += os.WIFSIGNALED(code) and os.WTERMSIG(code) == signal.SIGALRM
    finally:
        stop.set()
        thread.join()
    return hung


def test_a_plain_lock_held_at_fork_hangs_the_child():
    plain = threading.Lock()
    assert forked_children_that_hang(lambda: plain) == FORKS


ACTIVATION = registry.Activation("test", [])


@pytest.mark.parametrize("owner, attr", [
    (status, "_lock"), (log, "_lock"), (log, "_limit_lock"), (config, "_reported_lock"),
    (metrics, "_install_lock"), (_deps, "_lock"), (hotfix, "_lock"), (ACTIVATION, "lock"),
], ids=["status", "log", "log-limit", "config", "metrics", "deps", "activate", "activation"])
def test_each_lock_is_free_in_a_child_forked_while_a_thread_holds_it(owner, attr):
    assert forked_children_that_hang(lambda: getattr(owner, attr)) == 0


def test_a_child_forked_while_a_thread_counts_can_count(monkeypatch, tmp_path):
    """The review's reproduction: a parent thread counting, the child's first count."""
    monkeypatch.setenv("HOTFIX_STATUS_DIR", str(tmp_path))
    assert forked_children_that_hang(lambda: status._lock,
                                     in_child=lambda: status.count("lease-guard", "read_declined")) == 0
