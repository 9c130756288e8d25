"""The per-process status file keeps up with the counters without the hot path writing it
more than once an interval: a count inside the interval is written when the interval ends,
by a one-shot timer, even if nothing else happens (an idle engine)."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

from hotfix import registry, status


def test_a_count_inside_the_interval_reaches_the_file_when_the_interval_ends(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTFIX_STATUS_DIR", str(tmp_path))
    monkeypatch.setattr(status, "FLUSH_INTERVAL_S", 0.3)
    act = SimpleNamespace(source="test", snapshot=lambda: {})
    monkeypatch.setattr(registry, "activation", lambda: act)
    status._flush_scheduled = False  # a timer of an earlier test (10-s interval) may be pending

    def on_file() -> int:
        (path,) = tmp_path.glob("*.json")
        return json.loads(path.read_text())["counters"].get("flush-test", {}).get("seen", 0)

    before = status.counters().get("flush-test", {}).get("seen", 0)
    status.count("flush-test", "seen")  # a new kind: written at once
    status.count("flush-test", "seen")  # inside the interval: not written by this call
    assert on_file() == before + 1
    deadline = time.monotonic() + 5
    while on_file() != before + 2:
        assert time.monotonic() < deadline, "the count inside the interval never reached the file"
        time.sleep(0.05)
    status.count("flush-test", "seen")
    status.count("flush-test", "seen")  # one timer for any number of counts
    time.sleep(0.6)
    assert on_file() == before + 4
