"""Both entry points on the real installed vLLM: the shim, and vLLM's own plugin loader."""
from __future__ import annotations

import textwrap

from conftest import install_home, last_json, run_py

from hotfix import dist_info

PROBE = textwrap.dedent("""
    import json, sys
    import vllm
    {prelude}
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    import hotfix
    own = vars(Scheduler)["_update_from_kv_xfer_finished"]
    print(json.dumps({{
        "activated_by": hotfix.activated_by,
        "wrapped_by": getattr(own, "_self_hotfix_fix", None),
        "async_inherits": next(vars(c)["_update_from_kv_xfer_finished"] for c in AsyncScheduler.__mro__
                               if "_update_from_kv_xfer_finished" in vars(c)) is own,
    }}))
""")


def test_real_vllm_is_patched_through_pythonpath_alone(tmp_path):
    home = install_home(tmp_path / "home", fixes=("real_probe",))
    proc = run_py(PROBE.format(prelude=""), path=[home], timeout=300)
    assert last_json(proc) == {"activated_by": "sitecustomize", "wrapped_by": "real-probe",
                               "async_inherits": True}
    assert "hotfix" not in proc.stderr


def test_real_vllm_loads_the_plugin_entry_point_from_a_pythonpath_dist_info(tmp_path):
    home = install_home(tmp_path / "home", fixes=("real_probe",), shim=False)
    dist_info.write_dist_info(str(home))
    prelude = "from vllm.plugins import load_general_plugins; load_general_plugins()"
    proc = run_py(PROBE.format(prelude=prelude), path=[home], timeout=300)
    assert last_json(proc) == {"activated_by": "vllm_plugin", "wrapped_by": "real-probe",
                               "async_inherits": True}
