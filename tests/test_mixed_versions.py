"""Halves of two releases of this package (a staggered upgrade, Ray workers with their own copy)
never ship each other what the other may not unpickle: the fix degrades, nothing crashes.

Each side runs in a process of its own with one release's ``hotfix`` tree on its path (``git
archive`` of an earlier commit, or this checkout): the EngineCore side stamps metadata with its
``SchedulerHalf``, the worker side binds it with its ``WorkerHalf`` and, if it may, ships its
release's NIXL worker answer (what pull-pin and lease-guard send in ``kv_connector_worker_meta``),
and the EngineCore side unpickles that and hears it, as vLLM does with a worker's output.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, release_tree as tree

PREVIOUS = "932d821"  # the last release with the unversioned stamp (wire 1)
OLDER = "772249a^"  # before the NIXL answer class existed (what the review's reproduction used)
WIRE_2 = "7e98aed"  # the last release of wire 2 (before lease-guard's worker half judged leases)

STAMP = r"""
import pickle, sys, types
from hotfix.halves import SchedulerHalf
metadata = types.SimpleNamespace()
SchedulerHalf("pull-pin", 1).stamp(metadata)
sys.stdout.buffer.write(pickle.dumps(metadata))
"""

WORKER = r"""
import pickle, sys, json
from hotfix.halves import WorkerHalf
half = WorkerHalf("pull-pin")
half.bound(pickle.loads(sys.stdin.buffer.read()))
answer = None
if half.may_ship and half.presence():
    try:
        from hotfix.fixes._nixl_answer import NixlWorkerAnswer as Answer
    except ImportError:  # before 772249a: pull-pin's own class
        from hotfix.fixes.pull_pin import ReadsConfirmed as Answer
    answer = Answer({}, half.presence())
sys.stdout.buffer.write(pickle.dumps(answer))
print(json.dumps({"state": half.state, "shipped": answer is not None}), file=sys.stderr)
"""

HEAR = r"""
import pickle, sys, types, json
from hotfix.halves import SchedulerHalf
half = SchedulerHalf("pull-pin", 1)
half.stamp(types.SimpleNamespace())
try:
    answer = pickle.loads(sys.stdin.buffer.read())
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), file=sys.stderr)
    sys.exit(0)
half.heard(answer)
print(json.dumps({"state": half.state}), file=sys.stderr)
"""


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    root = tmp_path_factory.mktemp("releases")
    return {"this": REPO, PREVIOUS: tree(PREVIOUS, root / "previous"), OLDER: tree(OLDER, root / "older"),
            WIRE_2: tree(WIRE_2, root / "wire-2")}


def run(code: str, path: Path, data: bytes = b"") -> tuple[bytes, dict]:
    """``code`` with one release's tree on its path: (its stdout, the last JSON line it logged)."""
    proc = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=120,
                          cwd=path, env={"PYTHONPATH": str(path), "HOTFIX_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr.decode()
    lines = [line for line in proc.stderr.decode().splitlines() if line.startswith("{")]
    return proc.stdout, json.loads(lines[-1]) if lines else {}


def handshake(engine_core: Path, worker: Path) -> tuple[dict, dict]:
    """The EngineCore's stamp to the worker, the worker's answer back, each pickled as vLLM
    ships metadata and worker output; what each side ended with."""
    stamp, _ = run(STAMP, engine_core)
    answer, worker_side = run(WORKER, worker, stamp)
    _, engine_core_side = run(HEAR, engine_core, answer)
    return engine_core_side, worker_side


def test_previous_releases_worker_answer_kills_an_older_engine_core(trees):
    """The review's defect at today's main: its worker ships a class the older EngineCore lacks."""
    core, worker = handshake(trees[OLDER], trees[PREVIOUS])
    assert worker == {"state": "waiting", "shipped": True}
    assert core["error"].startswith("ModuleNotFoundError")


@pytest.mark.parametrize("engine_core, worker", [("this", PREVIOUS), (PREVIOUS, "this"), (OLDER, "this"),
                                                 ("this", WIRE_2), (WIRE_2, "this")],
                         ids=["old-worker", "old-engine-core", "older-engine-core",
                              "wire-2-worker", "wire-2-engine-core"])
def test_halves_of_two_releases_degrade_and_ship_nothing(trees, engine_core, worker):
    core, work = handshake(trees[engine_core], trees[worker])
    assert work == {"state": "degraded", "shipped": False}
    assert core == {"state": "degraded"}


def test_halves_of_one_release_agree(trees):
    assert handshake(trees["this"], trees["this"]) == ({"state": "agreed"}, {"state": "waiting", "shipped": True})
