"""``python -m hotfix bundle``: works where the image lacks our deps, never shadows its own."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from conftest import FIXTURES, build_bundle, clean_env, last_json, run_py

PROBE = textwrap.dedent("""
    import json, sys
    from vllm.v1.core.sched.scheduler import Scheduler
    import hotfix
    from hotfix import _deps
    image_wrapt = sys.modules.get("wrapt")
    chain, fn = [], vars(Scheduler)["_update_from_kv_xfer_finished"]
    while hasattr(fn, "_self_hotfix_fix"):
        chain.append(fn._self_hotfix_fix)
        fn = fn.__wrapped__
    print(json.dumps({
        "activated_by": hotfix.activated_by,
        "wrapped_by": "real-probe" if "real-probe" in chain else chain,
        "wrapt": _deps.origin("wrapt"),
        "structlog": _deps.origin("structlog"),
        "image_wrapt": getattr(image_wrapt, "__version__", None),
    }))
""")


# What the test venv has and an operator's image need not: the suite's own tools.
TEST_TOOLS = ("pytest", "_pytest", "py", "pluggy", "iniconfig", "hypothesis", "_hypothesis_globals",
              "_hypothesis_ftz_detector", "_hypothesis_pytestplugin")


@pytest.fixture(scope="module")
def shipped_bundle(tmp_path_factory):
    """The bundle exactly as ``python -m hotfix bundle`` lays it out."""
    return build_bundle(tmp_path_factory.mktemp("bundle") / "vllm-hotfix")


@pytest.fixture(scope="module")
def bundle(shipped_bundle, tmp_path_factory):
    """A copy of it carrying one more fix, ``real-probe``, whose wrapper the probes look for."""
    dest = tmp_path_factory.mktemp("probed-bundle") / "vllm-hotfix"
    shutil.copytree(shipped_bundle, dest, symlinks=True)
    shutil.copy2(FIXTURES / "fixes" / "real_probe.py", dest / "hotfix" / "fixes" / "real_probe.py")
    return dest


def venv_with_vllm_but_not(tmp_path: Path, hidden=("wrapt", "structlog")) -> Path:
    """A fresh venv that sees this venv's packages (vLLM, torch, ...) except ``hidden``."""
    visible = tmp_path / "visible"
    visible.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        if entry.name.split("-")[0].split(".")[0].lower() not in hidden and not entry.name.endswith(".pth"):
            os.symlink(entry, visible / entry.name)
    venv = tmp_path / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "image.pth").write_text(f"{visible}\n")
    return venv


def run_in(venv: Path, code: str, bundle: Path):
    env = clean_env(PYTHONPATH=str(bundle))
    return subprocess.run([str(venv / "bin" / "python"), "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, cwd=str(venv))


def test_bundle_has_shim_package_plugin_metadata_and_private_deps(bundle):
    assert (bundle / "sitecustomize.py").is_file()
    assert (bundle / "hotfix" / "registry.py").is_file()
    (info,) = bundle.glob("vllm_hotfix-*.dist-info")
    assert "hotfix = hotfix.plugin:register" in (info / "entry_points.txt").read_text()
    assert (bundle / "hotfix" / "_vendor" / "wrapt" / "__init__.py").is_file()
    assert (bundle / "hotfix" / "_vendor" / "structlog" / "__init__.py").is_file()


def test_bundle_works_in_an_image_without_wrapt_or_structlog(bundle, tmp_path):
    venv = venv_with_vllm_but_not(tmp_path)
    proc = run_in(venv, "import wrapt", bundle)
    assert proc.returncode != 0  # the image really has no wrapt
    out = last_json(run_in(venv, PROBE, bundle))
    assert out == {"activated_by": "sitecustomize", "wrapped_by": "real-probe", "wrapt": "private",
                   "structlog": "private", "image_wrapt": None}


def test_bundle_never_shadows_an_older_image_wrapt(bundle, tmp_path):
    venv = venv_with_vllm_but_not(tmp_path)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", purelib,
                    "wrapt==1.17.3"], check=True, env=clean_env())
    out = last_json(run_in(venv, PROBE + "\nimport wrapt; print(json.dumps(wrapt.__version__))", bundle))
    assert out == "1.17.3"
    out = last_json(run_in(venv, PROBE, bundle))
    assert out["wrapped_by"] == "real-probe" and out["wrapt"] == "private"
    assert out["image_wrapt"] == "1.17.3"  # the image's wrapt is what `import wrapt` still gives


def test_status_runs_from_the_bundle(bundle):
    proc = run_py("import sys; from hotfix.cli import main; sys.exit(main(['status']))", path=[bundle])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[APPLY] real-probe" in proc.stdout


def test_repro_from_the_bundle_runs_quietly_where_the_image_has_neither_the_checkout_nor_the_test_tools(
        shipped_bundle, tmp_path):
    venv = venv_with_vllm_but_not(tmp_path, hidden=("wrapt", "structlog", *TEST_TOOLS))
    for missing in ("wrapt", "structlog", "pytest", "hypothesis", "tests.worlds"):
        assert run_in(venv, f"import {missing}", shipped_bundle).returncode != 0, missing
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "hotfix", "repro"], cwd=str(venv),
                          env=clean_env(PYTHONPATH=str(shipped_bundle)), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    logs = Path(lines[0].split("logs in ", 1)[1])
    progress, table = lines[1:8], lines[9:17]
    assert all(": stock EngineCore dies: " in line or ": stock silent: " in line for line in progress), lines
    assert all(line.split(" | hotfix ")[1].startswith("clean (") for line in progress), lines
    assert table[0].split() == ["race", "stock", "vLLM", "with", "the", "hotfix"] and len(table) == 8, lines
    assert lines[-1] == "reproduced on stock vLLM and fixed by the hotfix" and len(lines) == 19, lines
    assert proc.stderr == ""  # quiet: vLLM's and the hotfix's logs went to files
    hotfix_log = (logs / "scheduler-hotfix.log").read_text()
    assert "event='hotfix.patch.applied'" in hotfix_log and "source='sitecustomize'" in hotfix_log
    assert f"{shipped_bundle}" not in (logs / "scheduler-stock.log").read_text()
    assert "event='hotfix." not in (logs / "scheduler-stock.log").read_text()
