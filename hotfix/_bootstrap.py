"""The lazy trigger: activate the hotfix when a process first imports ``vllm``.

Stdlib only. Installed by ``sitecustomize`` in every process; costs one ``sys.meta_path``
entry that answers ``None`` for every name but the top-level ``vllm``. On that import it
removes itself, activates, and hands back the spec the remaining finders produce, so the
import loop ends at us and no finder is skipped by our removal.
"""
from __future__ import annotations

import sys

#: True once the trigger is installed (tests and ``status`` read it); False if that failed.
loaded = False


class VllmImportTrigger:
    """Meta-path finder that fires once, on ``import vllm``."""

    def __init__(self) -> None:
        self.fired = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "vllm" or self.fired:
            return None
        self.fired = True
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        try:
            import hotfix

            hotfix.activate("sitecustomize")
        except Exception as exc:  # never break the host's `import vllm`
            _warn(f"activation failed ({type(exc).__name__}: {exc}); vLLM runs unpatched")
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                return spec
        return None


def _warn(message: str) -> None:
    try:
        sys.stderr.write(f"vllm-hotfix: {message}\n")
    except Exception:
        pass


def install() -> bool:
    """Put one trigger at the front of ``sys.meta_path`` unless vLLM is already imported."""
    global loaded
    try:
        if any(isinstance(f, VllmImportTrigger) for f in sys.meta_path):
            loaded = True
            return True
        if "vllm" in sys.modules:
            import hotfix

            hotfix.activate("sitecustomize")
        else:
            sys.meta_path.insert(0, VllmImportTrigger())
        loaded = True
    except Exception as exc:
        loaded = False
        _warn(f"bootstrap failed ({type(exc).__name__}: {exc}); vLLM runs unpatched")
    return loaded
