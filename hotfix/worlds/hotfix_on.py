"""Apply chosen fixes to the vLLM classes in this (test) process, and take them off again."""
from __future__ import annotations

from contextlib import contextmanager

from hotfix import registry


@contextmanager
def hotfix_active(*fix_ids: str):
    """The named fixes wrap the real vLLM classes inside the block, decided as in production
    (so a toggle set to ``off`` leaves them unapplied: check ``act.snapshot()``)."""
    modules = [m for m in registry.fix_modules() if m.SPEC.id in fix_ids]
    assert {m.SPEC.id for m in modules} == set(fix_ids), f"unknown fix in {fix_ids}"
    act = registry.Activation("test", modules).apply_now()
    try:
        yield act
    finally:
        act.revert_all("test finished")
