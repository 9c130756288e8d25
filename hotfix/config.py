"""``HOTFIX_*`` settings, read when a hook fires (Ray delivers env vars after start-up).

Never ``VLLM_*`` names: vLLM warns about unknown ones and can refuse to start. A bad value
gets one ERROR line naming the variable, the value, what is accepted and the default used
instead; under ``HOTFIX_STRICT=1`` it raises :class:`ConfigError`.
"""
from __future__ import annotations

import os
import sys
import threading

from hotfix import forksafe, log
from hotfix.log import BoundedSet

MODES = ("on", "off", "force")
LOG_FORMATS = ("console", "json")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

_reported = BoundedSet(cap=256)  # (variable, value) pairs already reported invalid
_reported_lock = threading.Lock()
forksafe.renew_in_child(sys.modules[__name__], "_reported_lock")


class ConfigError(ValueError):
    """An invalid ``HOTFIX_*`` value under ``HOTFIX_STRICT=1``."""


def _flag(var: str) -> "tuple[bool, bool]":
    """(value, valid) of a boolean variable; unset means False."""
    value = os.environ.get(var, "").strip().lower()
    if value in _TRUE:
        return True, True
    if value in _FALSE:
        return False, True
    return False, False


def strict() -> bool:
    """``HOTFIX_STRICT=1``: problems raise instead of being logged (CI, canaries)."""
    value, valid = _flag("HOTFIX_STRICT")
    if not valid:
        _invalid("HOTFIX_STRICT", _TRUE + ("0", "false", "no", "off"), "0 (log, don't raise)")
    return value


def problem(message: str, exc: "BaseException | None" = None) -> None:
    """Raise under ``HOTFIX_STRICT``; the caller has already logged the problem."""
    if strict():
        raise ConfigError(message) from exc


def fix_mode(var: str, default: str = "on") -> str:
    """``on`` | ``off`` | ``force`` for a fix's toggle variable."""
    return choice(var, MODES, default)


def choice(var: str, accepted, default: str) -> str:
    """One of ``accepted`` (case-insensitive); unset or empty means ``default``."""
    raw = os.environ.get(var)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in accepted:
        return value
    _invalid(var, accepted, default)
    return default


def seconds(var: str, default: float) -> float:
    """A non-negative number of seconds; unset or empty means ``default``."""
    raw = os.environ.get(var)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value >= 0.0 and value != float("inf"):
        return value
    _invalid(var, ("a number of seconds >= 0",), str(default))
    return default


def log_format() -> str:
    value = os.environ.get("HOTFIX_LOG_FORMAT", "").strip().lower()
    if value == "":
        return "console"
    if value in LOG_FORMATS:
        return value
    _invalid("HOTFIX_LOG_FORMAT", LOG_FORMATS, "console")
    return "console"


log.read_format_with(log_format)


def _invalid(var: str, accepted, default: str) -> None:
    raw = os.environ.get(var)
    key = (var, raw)
    with _reported_lock:
        first = _reported.add(key)
    message = (
        f"{var}={raw!r} is invalid: accepted values are {', '.join(repr(a) for a in accepted)};"
        f" using the default {default}"
    )
    if first:
        log.error("hotfix.config.invalid", variable=var, value=raw, accepted=list(accepted),
                  default=default, reason=message)
    if var != "HOTFIX_STRICT" and strict():
        raise ConfigError(message)
