"""What an engine's per-process status records say about pull-pin's pins."""
from __future__ import annotations

import time
from pathlib import Path

from hotfix import metrics, status


def pins_once_all_back(status_dir: Path, timeout_s: float = 30.0):
    """(engine view, /metrics series) once every pinned block is back, or at the deadline.
    The records are a flush interval behind, more when a worker is busy on a slow machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        (engine,) = metrics.engine_views(status.read_all(str(status_dir)))
        series = metrics.engine_summary(engine)["series"]
        if series["vllm:hotfix_blocks_released"] == series["vllm:hotfix_blocks_pinned"] > 0 \
                or time.monotonic() > deadline:
            return engine, series
        time.sleep(0.2)
