"""The /metrics collector on a prometheus_client registry: per-engine sums of status records,
vLLM's naming, and a scrape that never fails whatever the status directory holds."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hotfix import cli, metrics, status

MODEL = "tiny-llama"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def record(pid: int, kind: str, role: str, *, engine="0", rank=None, counters=None, gauges=None,
           fixes=None, ppid=None, **extra) -> dict:
    return {"pid": pid, "ppid": ppid or 1, "role": role, "identity": {"kind": kind},
            "model_name": MODEL if kind != "none" else None, "engine": engine, "rank": rank,
            "hotfix_version": "0.1.0", "vllm_version": "0.27.1",
            "fixes": fixes or {"recv-barrier": {"state": "applied"}, "xfer-guard": {"state": "applied"}},
            "counters": counters or {}, "gauges": gauges or {}, "exited_at": None, **extra}


def write_records(directory, *records) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for r in records:
        (directory / f"{r['pid']}.json").write_text(json.dumps(r))


def scrape(directory) -> dict:
    """{(name, labels...): value} of the hotfix's samples in one scrape."""
    registry = CollectorRegistry()
    registry.register(metrics.HotfixCollector(str(directory), MODEL))
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def sample(samples: dict, name: str, **labels):
    want = tuple(sorted({"model_name": MODEL, "engine": "0", **labels}.items()))
    return samples.get((name, want))


@pytest.fixture
def engine_dir(tmp_path):
    """An engine of two live processes: the EngineCore (this test's pid) and a worker."""
    directory = tmp_path / "status"
    core = record(os.getpid(), "engine_core", "EngineCore",
                  counters={"xfer-guard": {"recv_unknown": 2, "internal_error": 1}},
                  gauges={"xfer-guard": {"requests_held": 3}})
    worker = record(os.getppid(), "worker", "VllmWorker-0", rank=0,
                    counters={"recv-barrier": {"concurrent_load_held": 5, "stray_report": 1}})
    write_records(directory, core, worker)
    return directory


def test_series_are_summed_per_engine_and_named_like_vllms(engine_dir):
    samples = scrape(engine_dir)
    assert sample(samples, "vllm:hotfix_info", version="0.1.0", vllm_version="0.27.1") == 1
    assert sample(samples, "vllm:hotfix_processes") == 2
    assert sample(samples, "vllm:hotfix_concurrent_loads_held_total") == 5
    assert sample(samples, "vllm:hotfix_stray_load_reports_absorbed_total") == 1
    assert sample(samples, "vllm:hotfix_unexpected_completions_dropped_total", kind="recv_unknown") == 2
    assert sample(samples, "vllm:hotfix_unexpected_completions_dropped_total", kind="send_live") == 0
    assert sample(samples, "vllm:hotfix_requests_held") == 3
    assert sample(samples, "vllm:hotfix_internal_errors_total", fix="xfer-guard") == 1
    assert sample(samples, "vllm:hotfix_fix_active", fix="recv-barrier", state="applied",
                  reason="known_shape") == 1
    assert all(name.startswith("vllm:hotfix_") for name, _ in samples)
    assert not any(dict(labels).get("pid") for _, labels in samples)


def test_a_fix_degraded_in_one_worker_is_not_active_in_that_engine(engine_dir):
    worker = json.loads((engine_dir / f"{os.getppid()}.json").read_text())
    worker["fixes"]["recv-barrier"] = {"state": "degraded", "reason": "scheduler half missing: ..."}
    (engine_dir / f"{os.getppid()}.json").write_text(json.dumps(worker))
    samples = scrape(engine_dir)
    assert sample(samples, "vllm:hotfix_fix_active", fix="recv-barrier", state="degraded",
                  reason="half_missing") == 0
    assert sample(samples, "vllm:hotfix_fix_active", fix="xfer-guard", state="applied",
                  reason="known_shape") == 1


def test_dead_and_exited_processes_and_api_servers_are_not_counted(engine_dir):
    write_records(engine_dir,
                  record(dead_pid(), "engine_core", "EngineCore",
                         counters={"recv-barrier": {"concurrent_load_held": 100}}),
                  record(dead_pid(), "worker", "VllmWorker-0",
                         counters={"recv-barrier": {"concurrent_load_held": 100}}, exited_at=1.0),
                  record(1, "api_server", "MainProcess", engine=None,  # pid 1: alive, not an engine
                         counters={"recv-barrier": {"concurrent_load_held": 100}}))
    samples = scrape(engine_dir)
    assert sample(samples, "vllm:hotfix_concurrent_loads_held_total") == 5
    assert sample(samples, "vllm:hotfix_processes") == 2


def test_corrupt_partial_and_foreign_files_leave_the_scrape_intact(engine_dir):
    (engine_dir / "123.json").write_text('{"pid": 123, "counte')  # half-written
    (engine_dir / "garbage.json").write_text("not json")
    (engine_dir / "list.json").write_text("[1, 2]")
    (engine_dir / "456.json.99.tmp").write_text("{}")
    (engine_dir / f"{os.getpid() + 1}.json").write_text(json.dumps({"pid": os.getppid(), "role": "VllmWorker-1"}))
    samples = scrape(engine_dir)
    assert sample(samples, "vllm:hotfix_concurrent_loads_held_total") == 5


def test_a_missing_directory_gives_no_series_and_no_error(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="vllm.hotfix"):
        assert scrape(tmp_path / "nowhere") == {}
    assert not caplog.records


def test_a_raising_reader_costs_our_series_only_with_one_error(engine_dir, monkeypatch, caplog):
    def broken(_directory):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(status, "read_all", broken)
    registry = CollectorRegistry()
    from prometheus_client import Counter

    Counter("vllm:request_success", "vLLM's own", registry=registry).inc()
    registry.register(metrics.HotfixCollector(str(engine_dir), MODEL))
    with caplog.at_level(logging.ERROR, logger="vllm.hotfix"):
        text = generate_latest(registry).decode()
        generate_latest(registry)
    assert "vllm:request_success_total 1.0" in text and "vllm:hotfix_" not in text
    assert sum("hotfix.metrics.error" in r.getMessage() for r in caplog.records) == 1


def test_the_collector_survives_vllms_unregister_of_stale_vllm_collectors(engine_dir):
    from prometheus_client import REGISTRY

    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    collector = metrics.HotfixCollector(str(engine_dir), MODEL)
    REGISTRY.register(collector)
    try:
        unregister_vllm_metrics()
        assert collector in REGISTRY._collector_to_names
        assert b"vllm:hotfix_concurrent_loads_held_total" in generate_latest(REGISTRY)
    finally:
        REGISTRY.unregister(collector)


def test_the_multiprocess_registry_serves_our_series_after_its_own(engine_dir, tmp_path, monkeypatch):
    from prometheus_client import multiprocess

    from hotfix import _deps

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prom"))
    (tmp_path / "prom").mkdir()
    original = vars(multiprocess.MultiProcessCollector)["collect"]
    metrics._add_to_multiprocess_collector(metrics.HotfixCollector(str(engine_dir), MODEL))
    try:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        text = generate_latest(registry).decode()
        assert "vllm:hotfix_concurrent_loads_held_total" in text
    finally:
        wrapper = vars(multiprocess.MultiProcessCollector)["collect"]
        _deps.wrapt().unwrap_object(multiprocess.MultiProcessCollector, "collect", wrapper)
        assert vars(multiprocess.MultiProcessCollector)["collect"] is original


def test_status_runtime_prints_the_totals_the_scrape_shows(engine_dir, monkeypatch, capsys):
    monkeypatch.setenv("HOTFIX_STATUS_DIR", str(engine_dir))
    engine = cli.runtime_report()["instances"][0]["engines"][0]
    samples = scrape(engine_dir)
    assert engine["series"]["vllm:hotfix_concurrent_loads_held"] == \
        sample(samples, "vllm:hotfix_concurrent_loads_held_total")
    assert engine["series"]["vllm:hotfix_unexpected_completions_dropped"]["recv_unknown"] == 2
    assert engine["processes"] == sample(samples, "vllm:hotfix_processes")
    assert cli.main(["status", "--runtime"]) == 0
    out = capsys.readouterr().out
    assert "recv-barrier: ACTIVE (applied, known_shape)" in out
    assert "vllm:hotfix_concurrent_loads_held = 5" in out


def test_status_runtime_names_the_missing_half_of_a_degraded_fix(engine_dir, monkeypatch, capsys):
    """A partial rollout (Ray workers started without the hotfix) leaves no record of the
    workers: the EngineCore's record is where an operator reads which half is missing."""
    core = json.loads((engine_dir / f"{os.getpid()}.json").read_text())
    core["fixes"]["recv-barrier"] = {"state": "degraded", "reason": "worker half missing: 0 of 2 worker ranks"}
    write_records(engine_dir, core)
    monkeypatch.setenv("HOTFIX_STATUS_DIR", str(engine_dir))
    assert cli.main(["status", "--runtime"]) == 0
    out = capsys.readouterr().out
    assert "    recv-barrier degraded: worker half missing: 0 of 2 worker ranks" in out
    assert "xfer-guard applied:" not in out


def test_a_worker_that_exits_before_its_engine_core_keeps_its_counts(engine_dir):
    """Shutdown order: a worker's last record is marked exited while its EngineCore still runs.
    Dropping its counts made the engine's counters go down (read as a reset: rate() spikes and
    the rate > 0 alerts fire). Its gauges and its process no longer count."""
    worker = json.loads((engine_dir / f"{os.getppid()}.json").read_text())
    worker.update(ppid=os.getpid(), exited_at=1.0, gauges={"pull-pin": {"blocks_pinned_now": 4}})
    (engine_dir / f"{os.getppid()}.json").write_text(json.dumps(worker))
    samples = scrape(engine_dir)
    assert sample(samples, "vllm:hotfix_concurrent_loads_held_total") == 5
    assert sample(samples, "vllm:hotfix_stray_load_reports_absorbed_total") == 1
    assert sample(samples, "vllm:hotfix_processes") == 1
    assert sample(samples, "vllm:hotfix_blocks_pinned_now") == 0
