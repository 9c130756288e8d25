"""Shared helpers: a copy of the package with fixture fixes, and subprocess runners."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from hotfix.worlds.home import clean_env, hotfix_home
from hotfix.worlds.lmcache_server import LMCACHE_ROOT, release_dir

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
FAKE_VLLM = FIXTURES / "fakevllm"


@contextmanager
def faults_world(tmp_path_factory, name: str, bound_s: float, slack_s: float, **kwargs):
    """A ``FaultsWorld`` (``hotfix.worlds.faults``) with the real fixes on its hotfix engines,
    or a skip saying why this machine cannot make its two hosts."""
    from hotfix.worlds.faults import FaultsWorld
    from hotfix.worlds.two_hosts import NoNetworkNamespaces, TwoHosts

    try:
        TwoHosts(kwargs.get("prefill_clock_offset_s", 0))
    except NoNetworkNamespaces as exc:
        pytest.skip(f"two hosts need network (and, with a clock offset, time) namespaces: {exc}")
    root = tmp_path_factory.mktemp(name)
    home = install_home(root / "hotfix-home", fixes=())
    with FaultsWorld(root, clean_env(), home, bound_s, slack_s, **kwargs) as world:
        yield world


def install_home(dest: Path, fixes=("demo_guard",), vllm_root: Path = FAKE_VLLM,
                 entry_wrapper: str = "mark_entry", shim: bool = True) -> Path:
    """A PYTHONPATH directory like a bundle: shim + hotfix/ + fixes.

    With fixture ``fixes`` the package carries only those (the framework is tested alone);
    with ``fixes=()`` it carries the real fixes, as a bundle does. Fixture fingerprints
    are computed from ``vllm_root`` so the fixture fix matches it.
    """
    from hotfix import fingerprint

    hotfix_home(dest, shim=shim)
    if fixes:
        for real in (dest / "hotfix" / "fixes").glob("[!_]*.py"):
            real.unlink()
    sched = vllm_root / "vllm" / "v1" / "core" / "sched" / "scheduler.py"
    conn = str(FAKE_VLLM / "vllm" / "distributed" / "connector.py")
    values = {
        "@SCHEDULER@": fingerprint.of_file(str(sched), "Scheduler._update_from_kv_xfer_finished"),
        "@SHIM@": fingerprint.of_file(conn, "Connector.get_finished"),
        "@ENTRY@": fingerprint.of_file(conn, "Connector.get_transfer_results"),
        "@ENTRY_WRAPPER@": entry_wrapper,
    }
    for name in fixes:
        text = (FIXTURES / "fixes" / f"{name}.py").read_text()
        for key, value in values.items():
            text = text.replace(key, str(value))
        (dest / "hotfix" / "fixes" / f"{name}.py").write_text(text)
    return dest


def require_release(version: str) -> Path:
    """The release's directory; a skip where it is not installed, a failure where the CI leg
    installed lmcache (``HOTFIX_REQUIRE_LMCACHE=1``, set by .ci/leg.sh), so a missing install
    step can never turn these tests into skips."""
    path = release_dir(version)
    if path is None:
        missing_install(f"lmcache {version} is not under {LMCACHE_ROOT} (.ci/leg.sh installs it)",
                        "HOTFIX_REQUIRE_LMCACHE")
    return path


def release_tree(rev: str, dest: Path) -> Path:
    """The ``hotfix`` package of commit ``rev`` (this checkout's history) under ``dest``: an
    earlier release, for tests that run it beside this one."""
    import io
    import tarfile

    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "hotfix"], capture_output=True)
    assert archive.returncode == 0, f"git archive {rev}: {archive.stderr.decode()} (CI clones the full history)"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest)
    return dest


def settled_status(read, want=lambda value: True, timeout_s: float = 20.0):
    """``read()`` of status files once ``want`` holds and two reads a flush interval and a half
    apart agree (or at the deadline): a count or gauge is written by a timer up to one flush
    interval after it changed, later on a busy 2-core box, so one read right after an event can
    still show the value before it."""
    from hotfix import status

    deadline = time.monotonic() + timeout_s
    last = read()
    while True:
        time.sleep(status.FLUSH_INTERVAL_S * 1.5)
        now = read()
        if (now == last and want(now)) or time.monotonic() > deadline:
            return now
        last = now


def missing_install(message: str, required_by: str) -> None:
    """Skip, or fail where the CI leg installed the thing (``required_by``=1, set by
    .ci/leg.sh), so a lost install step can never turn a test into a skip."""
    if os.environ.get(required_by) == "1":
        pytest.fail(message)
    pytest.skip(message)


NEUTRAL_CWD = tempfile.mkdtemp(prefix="hotfix-cwd-")  # `python -c` puts the cwd on sys.path


def run_py(code: str, *, path=(), env=None, flags=(), timeout=120, cwd=NEUTRAL_CWD) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with exactly ``path`` on PYTHONPATH."""
    env = dict(env or clean_env())
    if path:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    return subprocess.run([sys.executable, *flags, "-c", code], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def build_bundle(dest: Path) -> Path:
    """``python -m hotfix bundle DEST`` from this checkout, as an operator builds it."""
    proc = subprocess.run([sys.executable, "-m", "hotfix", "bundle", str(dest)], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return dest


def last_json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def marked_by_selected_tests(request, marker: str) -> list[tuple]:
    """The arguments of ``marker`` on the tests of the requesting module this session runs
    (a module fixture starts only the engines or servers those tests use)."""
    found = []
    for item in request.session.items:
        if item.module is request.module:
            found.extend(mark.args for mark in item.iter_markers(marker))
    return found


@pytest.fixture
def decode_worlds(monkeypatch):
    """A builder of NIXL decode worlds (vLLM's real NIXL worker, a fake agent), closed after."""
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    from vllm.platforms import current_platform

    if not current_platform.device_type:  # a --no-deps vLLM (0.33.0, 0.34.0): no platform
        pytest.skip("NIXL's worker needs a vLLM platform with a device type")
    from hotfix.worlds.nixl_worker import DecodeWorld

    worlds = []

    def build():
        worlds.append(DecodeWorld(monkeypatch))
        return worlds[-1]

    yield build
    for w in worlds:
        w.close()


@pytest.fixture
def home(tmp_path):
    return install_home(tmp_path / "home")


@pytest.fixture
def status_env(tmp_path):
    return clean_env(HOTFIX_STATUS_DIR=str(tmp_path / "status"))


def pytest_collection_modifyitems(config, items):
    """Under .ci/leg.sh (``HOTFIX_CI_BUDGET=1``) the tests marked ``beyond_ci_budget`` are
    deselected before any module fixture starts their engines: each starts engines of its own
    for a claim another CI test proves too (the mark names it). ``pytest tests`` runs them."""
    if os.environ.get("HOTFIX_CI_BUDGET") != "1":
        return
    beyond = [item for item in items if item.get_closest_marker("beyond_ci_budget")]
    if beyond:
        config.hook.pytest_deselected(items=beyond)
        items[:] = [item for item in items if not item.get_closest_marker("beyond_ci_budget")]


def pytest_sessionstart(session):
    """A run killed mid-way (a timeout, a stopped session) leaves its engines and servers
    running in sessions of their own; they would slow this run's races and hold its memory."""
    from hotfix.worlds.home import reap_orphans
    from hotfix.worlds.pd_world import remove_orphaned_cpu_shm
    from hotfix.worlds.two_hosts import reap_orphan_namespaces

    killed = reap_orphans()
    if killed:
        print(f"\nreaped {len(killed)} processes an earlier, killed run of the worlds left behind: {killed}")
    remove_orphaned_cpu_shm()
    gone = reap_orphan_namespaces()
    if gone:
        print(f"\ndeleted the network namespaces of an earlier, killed run: {gone}")
