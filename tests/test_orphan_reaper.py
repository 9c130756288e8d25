"""What a killed world run leaves behind is found by its owner mark and reaped; nothing of a
live run is touched."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from hotfix.status import pid_alive
from hotfix.worlds.home import OWNER_VAR, clean_env, reap_orphans

# The owner starts a long-lived "engine" in a session of its own, as the worlds do, prints its
# pid and waits to be killed.
OWNER = (
    "import subprocess, sys, time\n"
    "from hotfix.worlds.home import clean_env\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
    "                         env=clean_env(), start_new_session=True)\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_an_engine_whose_run_was_killed_is_reaped_and_one_of_a_live_run_is_not():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    owner = subprocess.Popen([sys.executable, "-c", OWNER], env=env, stdout=subprocess.PIPE, text=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=clean_env(),
                            start_new_session=True)
    try:
        orphan = int(owner.stdout.readline())
        assert f"{OWNER_VAR}={owner.pid}".encode() in open(f"/proc/{orphan}/environ", "rb").read()
        assert reap_orphans() == [], "the owner still runs: nothing is an orphan yet"
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert alive(orphan), "a killed run's engine outlives it (its own session)"

        assert orphan in reap_orphans()
        deadline = time.monotonic() + 10
        while alive(orphan) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(orphan)
        assert live.poll() is None, "a process of this (live) run is left alone"
    finally:
        for proc in (owner, live):
            proc.kill()
            proc.wait(10)


# A world's API server (a session leader) whose EngineCore outlives it: vLLM's setproctitle
# overwrites the EngineCore's /proc environ, so only its session and the marked resource
# tracker beside it say whose it is. The leader starts both, prints their pids and exits.
LEADER = (
    "import os, subprocess, sys\n"
    "from hotfix.worlds.home import OWNER_VAR\n"
    "sleep = [sys.executable, '-c', 'import time; time.sleep(120)']\n"
    "tracker = subprocess.Popen(sleep)\n"
    "renamed = subprocess.Popen(sleep, env={k: v for k, v in os.environ.items() if k != OWNER_VAR})\n"
    "print(tracker.pid, renamed.pid, flush=True)\n"
    "os._exit(0)\n"
)
SERVER_OWNER = (
    "import os, subprocess, sys, time\n"
    "from hotfix.worlds.home import clean_env\n"
    "env = dict(clean_env(), PYTHONPATH=os.environ['PYTHONPATH'])\n"
    f"leader = subprocess.Popen([sys.executable, '-c', {LEADER!r}], env=env, start_new_session=True,\n"
    "                          stdout=subprocess.PIPE, text=True)\n"
    "print(leader.stdout.readline().strip(), flush=True)\n"
    "leader.wait()\n"
    "time.sleep(120)\n"
)


def test_an_engine_whose_environ_was_renamed_away_is_reaped_by_its_dead_servers_session():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    owner = subprocess.Popen([sys.executable, "-c", SERVER_OWNER], env=env, stdout=subprocess.PIPE, text=True)
    tracker = renamed = None
    try:
        tracker, renamed = (int(pid) for pid in owner.stdout.readline().split())
        assert OWNER_VAR.encode() not in open(f"/proc/{renamed}/environ", "rb").read()
        assert reap_orphans() == [], "the owner still runs: nothing is an orphan yet"
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)

        assert {tracker, renamed} <= set(reap_orphans())
        deadline = time.monotonic() + 10
        while (alive(tracker) or alive(renamed)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(tracker) and not alive(renamed)
    finally:
        owner.kill()
        owner.wait(10)
        for pid in (tracker, renamed):
            if pid and alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_exited_server_nobody_reaped_counts_as_gone():
    """A killed run's API server can outlive its owner as a zombie: the owner died before it
    reaped it, and a container's init may never do so. Its session is leaderless all the
    same, or the engines in it would never be reaped (CI, stop 37)."""
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while alive(exited.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(f"/proc/{exited.pid}"), "a zombie until it is waited for"
        assert not pid_alive(exited.pid)
    finally:
        exited.wait(10)
    assert not pid_alive(exited.pid)
    assert pid_alive(os.getpid())
