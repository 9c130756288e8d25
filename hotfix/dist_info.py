"""Our plugin's metadata for a bundle directory: below both the CLI and the test worlds."""
from __future__ import annotations

import os

from hotfix._version import __version__

PLUGIN = "hotfix"
PLUGIN_GROUP = "vllm.general_plugins"


def write_dist_info(dest: str) -> str:
    """A minimal dist-info: ``importlib.metadata`` finds our plugin entry point on PYTHONPATH."""
    info = os.path.join(dest, f"vllm_hotfix-{__version__}.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as fh:
        fh.write(f"Metadata-Version: 2.1\nName: vllm-hotfix\nVersion: {__version__}\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as fh:
        fh.write(f"[{PLUGIN_GROUP}]\n{PLUGIN} = hotfix.plugin:register\n")
    with open(os.path.join(info, "top_level.txt"), "w") as fh:
        fh.write("hotfix\nsitecustomize\n")
    return info
