"""The real LMCache server (``lmcache server``) for the worlds: one per test module.

It runs the lmcache release found under ``$VENV/lmcache/<version>`` (``.ci/leg.sh`` installs
0.5.4 and 0.5.6 there, ``--no-deps``, outside site-packages) in its own session, on free
loopback ports (ZMQ for the connectors, HTTP for ``/healthcheck``), CPU only: its L1 pool is
allocated up front in the server's own memory, so ``--l1-size-gb 1`` costs about 1.4 GB of
RSS. Stopping it ends the whole process group and removes any ``/dev/shm`` entry with
"lmcache" in its name that appeared while it ran, on success, failure and timeout alike.

Two transfer modes (``transfer_mode``; the connector config names the same one):

* ``lmcache_driven`` (the default, the bug report's): the server reads and writes the
  engine's KV itself. On CPU the worker makes that possible by moving its KV cache tensors
  into shared memory (``tensor.set_()`` onto a ``/dev/shm/lmcache_kv_*`` segment) when
  MultiConnector registers the caches — after NIXL, listed first, has registered the
  original buffers. NIXL's READs then land in memory the model no longer reads (measured:
  a NIXL-only transfer decodes wrong from its second token, 0.5.4 and 0.5.6 alike). On GPU
  the same mode shares the memory through CUDA IPC without moving it.
* ``engine_driven``: the worker copies between its own KV tensors and a server-side SHM
  segment (``--shm-name``, "lmcache" in its name), so the KV stays where NIXL registered
  it. The P/D world, where NIXL and LMCache share the decode's KV, uses this one.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from hotfix.worlds.home import SessionServer

LMCACHE_ROOT = Path(sys.prefix) / "lmcache"
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0
SHM = Path("/dev/shm")
_LAUNCH = ("import sys; sys.argv[0] = 'lmcache'; "
           "from lmcache.cli.main import main; sys.exit(main())")


class LMCacheServerFailure(RuntimeError):
    pass


def release_dir(version: str) -> Path | None:
    """Where that lmcache release is installed, or None."""
    path = LMCACHE_ROOT / version
    return path if (path / "lmcache").is_dir() else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LMCacheServer(SessionServer):
    """``with LMCacheServer(release, log_path, env) as server:`` — ``server.connector_config()``
    is the ``kv_connector_extra_config`` of an ``LMCacheMPConnector`` that talks to it."""

    def __init__(self, release: Path | None, log_path: Path, env: dict, l1_size_gb: int = 1,
                 transfer_mode: str = "lmcache_driven") -> None:
        """``release``: a directory holding an lmcache install, or None for the one this
        interpreter imports."""
        self.release = release
        self.log_path = log_path
        self.env = {**env, "LMCACHE_TRACK_USAGE": "false"}
        if release is not None:
            self.env["PYTHONPATH"] = str(release)
        self.l1_size_gb = l1_size_gb
        self.transfer_mode = transfer_mode
        self.port = self.http_port = 0
        self.process: subprocess.Popen | None = None
        self._shm_before: set[str] = set()

    def connector_config(self) -> dict:
        # The mode is always named: a CPU worker would otherwise ask for engine_driven
        # transfers, which a default server does not offer ("No handler registered ...").
        return {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port,
                "lmcache.mp.mp_transfer_mode": self.transfer_mode, "lmcache.mp.mq_timeout": 60}

    def __enter__(self) -> "LMCacheServer":
        self.port, self.http_port = _free_port(), _free_port()
        self._shm_before = {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()
        self._launch(self._command())
        return self

    def restart(self) -> None:
        """A new server in place of this one (ended first, if a test did not kill it), on the
        same ports and SHM name: a restarted pod behind the same address, to the engines that
        registered with the old one. Only this server's own pool is removed: other servers of
        the world started after it and run on."""
        self._end()
        own = f"lmcache_world_{self.port}"
        for path in self.leftovers():
            if own in path.name:
                path.unlink(missing_ok=True)
        self._launch(self._command())

    def _command(self) -> list[str]:
        command = [sys.executable, "-c", _LAUNCH, "server",
                   "--host", "127.0.0.1", "--port", str(self.port),
                   "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                   "--l1-size-gb", str(self.l1_size_gb), "--eviction-policy", "LRU",
                   "--chunk-size", "256", "--disable-metrics"]
        if self.transfer_mode == "engine_driven":
            command += ["--supported-transfer-mode", "engine_driven", "--shm-name", f"lmcache_world_{self.port}"]
        return command

    def healthy(self) -> bool:
        url = f"http://127.0.0.1:{self.http_port}/healthcheck"
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.healthy():
            if self.process.poll() is not None:
                raise LMCacheServerFailure(f"lmcache server exited {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise LMCacheServerFailure(f"lmcache server not healthy after {START_TIMEOUT_S:.0f} s:\n"
                                           f"{self.log_tail()}")
            time.sleep(0.5)

    def leftovers(self) -> list[Path]:
        """LMCache's entries in /dev/shm that were not there before the server started."""
        if not SHM.is_dir():
            return []
        return sorted(p for p in SHM.iterdir() if "lmcache" in p.name and p.name not in self._shm_before)

    def resume(self) -> None:
        """Continue a server a test (or a world connector) SIGSTOPped: a hung server, not a
        dead one."""
        try:
            os.killpg(self.process.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """End the server's process group (TERM, then KILL; continued first, so a stopped
        server ends too) and remove its /dev/shm pool."""
        if self.process is None:
            return
        self._end()
        for path in self.leftovers():
            path.unlink(missing_ok=True)

    def _end(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self.resume()
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:  # the server if it ignored TERM, and whatever it started itself
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
