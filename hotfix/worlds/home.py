"""What a world's processes are given: an environment with nothing of ours in it, and a
directory that delivers this hotfix the way an operator deploys it (``PYTHONPATH=DIR``)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import hotfix
from hotfix.status import pid_alive

DEPLOYED_FROM = Path(hotfix.__file__).resolve().parent.parent  # a checkout, a bundle or site-packages
# Every process a world starts (and all it starts: EngineCore, workers, LMCache's server) carries
# the pid of the process that ran the world, so what a killed run left behind can be found.
OWNER_VAR = "HOTFIX_WORLD_OWNER"


class NotDeployable(RuntimeError):
    """This copy of the hotfix has no shim beside it (a pip install): there is nothing to put on
    an engine's PYTHONPATH."""


def clean_env(**extra) -> dict:
    """The parent's environment without anything that would inject or configure us, marked
    with this process as the world's owner (``reap_orphans``)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HOTFIX_") and k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    env["HF_HUB_OFFLINE"] = "1"
    env[OWNER_VAR] = str(os.getpid())
    env.update(extra)
    return env


def reap_orphans(tracker_grace_s: float = 10.0) -> list[int]:
    """SIGKILL every process a world started for a run that no longer exists, and return their
    pids. Engines and servers live in sessions of their own, so a run killed mid-way (a
    timeout, a stopped session) leaves them running: hundreds of MiB each and CPU time that
    the next run's races and timeouts would pay for. multiprocessing's resource trackers go
    last: once the processes they watch are gone they unlink vLLM's shared memory and exit."""
    orphans = _orphans()
    killed = _kill([pid for pid, cmdline in orphans if b"resource_tracker" not in cmdline])
    deadline = time.monotonic() + tracker_grace_s
    while any(b"resource_tracker" in cmdline for _, cmdline in _orphans()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return killed + _kill([pid for pid, _ in _orphans()])


def _orphans() -> list[tuple[int, bytes]]:
    """(pid, command line) of each process whose world owner is gone, and of every process in
    the session of such a process once its session leader is gone too: vLLM renames its
    EngineCore and workers (setproctitle), which overwrites their /proc environ, so after their
    API server died only the session (the world starts each server in one of its own) and a
    marked sibling (multiprocessing's resource tracker) still say whose they are."""
    needle = f"{OWNER_VAR}=".encode()
    processes, marked = [], []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
            session = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3])
        except (OSError, ValueError, IndexError):
            continue
        processes.append((int(entry.name), cmdline, session))
        owner = next((v[len(needle):] for v in environ if v.startswith(needle)), b"")
        if owner.isdigit() and not pid_alive(int(owner)):
            marked.append(int(entry.name))
    ours = os.getsid(0)
    leaderless = {session for pid, _, session in processes
                  if pid in marked and session != ours and not pid_alive(session)}
    return [(pid, cmdline) for pid, cmdline, session in processes if pid in marked or session in leaderless]


def _kill(pids: list[int]) -> list[int]:
    killed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            pass
    return killed


def hotfix_home(dest: Path, shim: bool = True) -> Path:
    """``dest`` laid out like a bundle, from the hotfix this process runs: the shim (unless
    ``shim=False``: then only vLLM's plugin loader can find it) and the package, with its
    private dependencies where it has them."""
    source_shim = DEPLOYED_FROM / "sitecustomize.py"
    if not source_shim.is_file():
        raise NotDeployable(f"no sitecustomize.py beside {DEPLOYED_FROM / 'hotfix'}: run this from a "
                            "checkout or a bundle (python -m hotfix bundle DIR; PYTHONPATH=DIR)")
    dest.mkdir(parents=True, exist_ok=True)
    if shim:
        shutil.copy2(source_shim, dest / "sitecustomize.py")
    shutil.copytree(DEPLOYED_FROM / "hotfix", dest / "hotfix", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return dest


class SessionServer:
    """A server a world starts in a session of its own (so it can be ended with everything it
    started), logging to ``log_path``. Subclasses say when it is ready and how it stops; a
    start that does not become ready stops it before the error goes up."""

    log_path: Path
    env: dict
    process: subprocess.Popen | None = None

    def _launch(self, command: list[str]) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])
