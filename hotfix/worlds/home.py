"""What a world's processes are given: an environment with nothing of ours in it, and a
directory that delivers this hotfix the way an operator deploys it (``PYTHONPATH=DIR``)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import hotfix

DEPLOYED_FROM = Path(hotfix.__file__).resolve().parent.parent  # a checkout, a bundle or site-packages


class NotDeployable(RuntimeError):
    """This copy of the hotfix has no shim beside it (a pip install): there is nothing to put on
    an engine's PYTHONPATH."""


def clean_env(**extra) -> dict:
    """The parent's environment without anything that would inject or configure us."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HOTFIX_") and k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    env["HF_HUB_OFFLINE"] = "1"
    env.update(extra)
    return env


def hotfix_home(dest: Path, shim: bool = True) -> Path:
    """``dest`` laid out like a bundle, from the hotfix this process runs: the shim (unless
    ``shim=False``: then only vLLM's plugin loader can find it) and the package, with its
    private dependencies where it has them."""
    source_shim = DEPLOYED_FROM / "sitecustomize.py"
    if not source_shim.is_file():
        raise NotDeployable(f"no sitecustomize.py beside {DEPLOYED_FROM / 'hotfix'}: run this from a "
                            "checkout or a bundle (python -m hotfix bundle DIR; PYTHONPATH=DIR)")
    dest.mkdir(parents=True, exist_ok=True)
    if shim:
        shutil.copy2(source_shim, dest / "sitecustomize.py")
    shutil.copytree(DEPLOYED_FROM / "hotfix", dest / "hotfix", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return dest
