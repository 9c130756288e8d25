"""Run a scenario stock and with fixes, and summarise what the world saw."""
from __future__ import annotations

from hotfix.worlds.hotfix_on import hotfix_active
from hotfix.worlds.scheduler_world import patched_methods


def run_stock(scenario):
    assert patched_methods() == [], "vLLM is patched in this process"
    return scenario.run()


def run_fixed(scenario, *fix_ids):
    with hotfix_active(*fix_ids) as act:
        states = act.snapshot()
        result = scenario.run()
    return result, states


def verdicts(result) -> tuple:
    """Everything the tracker and the crash say, comparable between two runs."""
    crash = None
    if result.crash is not None:
        crash = (type(result.crash.exc).__name__, result.crash.source_line,
                 result.crash.enclosing_loop(), result.crash.step)
    return crash, sorted((v.kind, v.step, v.req_id, v.who, v.block) for v in result.violations)


def delivered_at(result, req_id: str, kind: str = "recv") -> list:
    """Ticks at which the scheduler was told ``req_id`` finished (after aggregation);
    ``kind="failed"``: told its load failed (``failed_recving``, vLLM 0.30+)."""
    attr = {"recv": "delivered_recving", "send": "delivered_sending",
            "failed": "delivered_failed"}[kind]
    return [s.step for s in result.steps if req_id in getattr(s, attr)]


def finished(result, req_id: str):
    return next(((s.step, s.finished[req_id]) for s in result.steps if req_id in s.finished), None)
