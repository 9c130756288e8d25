"""vllm-hotfix: runtime fixes for vLLM's KV-transfer races, applied without a rebuild.

This module must stay stdlib-only and cheap: the ``sitecustomize`` shim imports it in
every Python process that has our directory on ``PYTHONPATH``. Everything heavy (wrapt,
structlog, the fix specs) is imported by :func:`activate`, i.e. only in processes that
import vLLM.
"""
from __future__ import annotations

import _thread  # not `threading`: its import alone costs ~8 ms in every Python process
import os

from hotfix._version import __version__  # noqa: F401 - the package's public version

_lock = _thread.allocate_lock()


def _renew_lock_in_child() -> None:
    """A child forked while a thread held the lock gets a free one (see ``hotfix.forksafe``)."""
    global _lock
    _lock = _thread.allocate_lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock_in_child)
#: which entry point activated this process first ("sitecustomize", "vllm_plugin", ...).
activated_by = None


def activate(source: str) -> bool:
    """Register the fixes' import hooks once per process; True if this call did it.

    Idempotent: the sitecustomize trigger and the vLLM plugin entry point both call it,
    and a forked child inherits the parent's activation (and its patches).
    """
    global activated_by
    if _disabled():
        return False
    with _lock:
        if activated_by is not None:
            return False
        activated_by = source
    from hotfix import identity, registry

    registry.install_hooks(source)
    identity.install()
    return True


def _disabled() -> bool:
    """``HOTFIX_DISABLE`` set to anything but a false value: the kill switch, for every entry
    point (the shim reads it itself and never imports us then)."""
    import os

    return os.environ.get("HOTFIX_DISABLE", "").strip().lower() not in ("", "0", "false", "no", "off")
