"""Locks a forked child gets afresh (stdlib only).

vLLM forks its EngineCore and workers while our threads may run (the status timer, a hook on
a NIXL or ZMQ thread): a lock one of them holds at that moment is held for ever in the child,
whose first use of it then hangs. :func:`renew_in_child` registers, once per lock, a fresh
lock for the child (``os.register_at_fork``); the parent's lock is untouched.
"""
from __future__ import annotations

import os
import threading
import weakref


def renew_in_child(owner, attr: str, factory=threading.Lock) -> None:
    """After a fork, the child's ``owner.<attr>`` is a new ``factory()`` lock (or other state
    that only the parent's threads could have set: a count of them, what they work on).
    ``owner`` (a module or an object) is held weakly: an owner gone by then is skipped."""
    if not hasattr(os, "register_at_fork"):
        return
    ref = weakref.ref(owner)

    def renew() -> None:
        target = ref()
        if target is not None:
            setattr(target, attr, factory())

    os.register_at_fork(after_in_child=renew)
