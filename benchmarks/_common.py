"""Shared bits of the benchmarks: timing loops and applying a fix to the real vLLM classes."""
from __future__ import annotations

import os
import statistics
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def per_call_us(fn, calls: int = 2000, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean per-call time in microseconds."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def applied(*fix_ids: str):
    """Apply fixes to the real vLLM classes (as in production); returns the activation."""
    from hotfix import registry

    modules = [m for m in registry.fix_modules() if m.SPEC.id in fix_ids]
    act = registry.Activation("benchmark", modules).apply_now()
    for fix_id, state in act.snapshot().items():
        if state["state"] != registry.APPLIED:
            raise SystemExit(f"{fix_id} did not apply here: {state}")
    return act


def retained_bytes(build, churn) -> tuple:
    """(bytes held by a fresh structure, bytes held after ``churn`` ran through it)."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    state = build()
    empty = tracemalloc.get_traced_memory()[0] - base
    churn(state)
    after = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return state, empty, after


def ratio_ci95(numerator: list[float], denominator: list[float], *, resamples: int = 10_000,
               seed: int = 0) -> list[float] | None:
    """95% percentile-bootstrap interval of ``mean(numerator) / mean(denominator)``: each
    side's samples (a variant's rounds) drawn with replacement, ``resamples`` times, seeded
    so a report is reproducible from its rounds. None with fewer than two samples a side."""
    import random

    if len(numerator) < 2 or len(denominator) < 2:
        return None
    rng = random.Random(seed)
    ratios = sorted(
        statistics.fmean(rng.choices(numerator, k=len(numerator)))
        / statistics.fmean(rng.choices(denominator, k=len(denominator)))
        for _ in range(resamples))
    return [round(ratios[int(0.025 * resamples)], 4), round(ratios[int(0.975 * resamples) - 1], 4)]
