"""Make one process of an engine run without the hotfix (engine and P/D worlds).

A test connector calls :func:`drop_hotfix_if_asked` from its ``__init__`` in every process
vLLM builds it in; when its ``kv_connector_extra_config`` says ``drop_hotfix_in`` is this
side (``"scheduler"``: the EngineCore, ``"worker"``: a worker), that process becomes one the
hotfix did not reach (a Ray worker without our PYTHONPATH, an EngineCore from another image):
every wrapper is reverted and our fix modules can no longer be imported, so unpickling one of
their classes there fails as it would in a process without ``hotfix``. Imported as a flat
module by the P/D world's copied connectors, and as ``hotfix.worlds.without_hotfix`` by the
engine world's.
"""
from __future__ import annotations

import sys


def drop_hotfix_if_asked(extra_config: dict, is_scheduler: bool) -> None:
    side = "scheduler" if is_scheduler else "worker"
    if extra_config.get("drop_hotfix_in") != side or sys.modules.get("hotfix") is None:
        return
    from hotfix import registry

    act = registry.activation()
    if act is not None:
        act.revert_all(f"test world: this {side} runs without the hotfix")
    for name in [m for m in sys.modules if m.startswith("hotfix.fixes.")]:
        sys.modules[name] = None
