"""Helpers for wrappers on vLLM's hot paths (the EngineCore busy loop, worker steps).

An internal error of a fix must never escape into vLLM's loop: an exception there stops
the engine and fails every request. Wrappers catch their own errors and call
:func:`contain`, which logs (rate-limited), counts, and lets the wrapper take its declared
safe fallback; under ``HOTFIX_STRICT=1`` it re-raises instead.
"""
from __future__ import annotations

from hotfix import config, log, status


class Violation(AssertionError):
    """A connector-contract violation, raised only under ``HOTFIX_STRICT=1``."""


def contain(fix: str, target: str, exc: BaseException, fallback: str) -> None:
    status.count(fix, "internal_error")
    log.limited((fix, target, type(exc).__name__), "error", "hotfix.runtime.error", fix=fix,
                target=target, reason=f"{type(exc).__name__}: {exc}", fallback=fallback,
                exc_info=exc)
    if config.strict():
        raise exc


def argument(args: tuple, kwargs: dict, index: int, name: str):
    """The wrapped call's argument ``name`` (``index``-th positional, ``self`` excluded)."""
    if name in kwargs:
        return kwargs[name]
    return args[index]


def state_of(instance, name: str, factory):
    """Per-instance fix state kept in ``instance.__dict__[name]``, created on first use: vLLM
    builds its connectors before any hook could add state in ``__init__``."""
    state = instance.__dict__.get(name)
    if state is None:
        state = instance.__dict__[name] = factory()
    return state


def violation(message: str) -> None:
    """Raise :class:`Violation` under ``HOTFIX_STRICT=1`` (after the caller logged it)."""
    if config.strict():
        raise Violation(message)
