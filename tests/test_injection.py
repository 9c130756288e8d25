"""The PYTHONPATH shim and the plugin entry point, in real interpreters (fake vLLM layout)."""
from __future__ import annotations

import json
import textwrap

import pytest

from conftest import FAKE_VLLM, NEUTRAL_CWD, clean_env, install_home, last_json, run_py

PROBE = textwrap.dedent("""
    import json, sys
    import vllm.v1.core.sched.scheduler as s
    import vllm.distributed.connector as c
    import hotfix
    try:
        s.Scheduler()._update_from_kv_xfer_finished(["r1", "gone"])
        survived = True
    except AssertionError:
        survived = False
    print(json.dumps({
        "activated_by": hotfix.activated_by,
        "survived": survived,
        "entry": sorted(c.Connector().get_finished({"a"})),
        "hotfix_modules": sorted(m for m in sys.modules if m.split(".")[0] in ("hotfix", "wrapt", "structlog")),
        "triggers": [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "VllmImportTrigger"],
    }))
""")


def test_pythonpath_alone_patches_the_process(home):
    proc = run_py(PROBE, path=[home, FAKE_VLLM])
    out = last_json(proc)
    assert out["activated_by"] == "sitecustomize"
    assert out["survived"] is True
    assert out["entry"] == ["a", "marked"]  # get_transfer_results wrapped, the shim left alone
    assert out["triggers"] == []  # the trigger removed itself
    assert proc.stderr == ""


@pytest.mark.parametrize("flag", ["-S", "-I", "-E"])
def test_isolating_flags_leave_the_process_unpatched_and_quiet(home, flag):
    code = "import sys; sys.path[:0] = %r; " % [str(FAKE_VLLM)] + PROBE.replace(
        '"activated_by": hotfix.activated_by,', '"activated_by": None,').replace("import hotfix\n", "")
    proc = run_py(code, path=[home, FAKE_VLLM], flags=[flag])
    out = last_json(proc)
    assert out["survived"] is False
    assert out["hotfix_modules"] == []
    assert proc.stderr == ""


def test_kill_switch_leaves_no_finder_and_no_wrapt(home):
    code = PROBE.replace("import hotfix\n", "").replace('"activated_by": hotfix.activated_by,', "")
    proc = run_py(code, path=[home, FAKE_VLLM], env=clean_env(HOTFIX_DISABLE="1"))
    out = last_json(proc)
    assert out["survived"] is False
    assert out["hotfix_modules"] == []
    assert out["triggers"] == []
    assert proc.stderr == ""


def test_kill_switch_with_a_typo_still_disables_and_says_so(home):
    code = PROBE.replace("import hotfix\n", "").replace('"activated_by": hotfix.activated_by,', "")
    proc = run_py(code, path=[home, FAKE_VLLM], env=clean_env(HOTFIX_DISABLE="ture"))
    assert last_json(proc)["survived"] is False
    assert proc.stderr.count("HOTFIX_DISABLE") == 1


def _other_sitecustomize(tmp_path, body: str):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text(body)
    return other


def test_next_sitecustomize_runs_exactly_once(home, tmp_path):
    marker = tmp_path / "ran.txt"
    other = _other_sitecustomize(tmp_path, f"open({str(marker)!r}, 'a').write('x')\n")
    proc = run_py(PROBE + "\nimport sitecustomize\n", path=[home, other, FAKE_VLLM])
    assert last_json(proc)["survived"] is True
    assert marker.read_text() == "x"


def test_without_another_sitecustomize_ours_stays_registered(home):
    proc = run_py("import sys, json; print(json.dumps(sys.modules['sitecustomize'].__file__))",
                  path=[home, FAKE_VLLM])
    assert last_json(proc) == str(home / "sitecustomize.py")


def test_broken_next_sitecustomize_does_not_stop_ours(home, tmp_path):
    other = _other_sitecustomize(tmp_path, "raise RuntimeError('image sitecustomize is broken')\n")
    proc = run_py(PROBE, path=[home, other, FAKE_VLLM])
    assert last_json(proc)["survived"] is True
    assert "next sitecustomize failed" in proc.stderr


CHILD = textwrap.dedent("""
    import json, multiprocessing as mp, sys

    def probe(q):
        import vllm.v1.core.sched.scheduler as s
        import hotfix
        q.put([hotfix.activated_by, hasattr(vars(s.Scheduler)["_update_from_kv_xfer_finished"], "__wrapped__")])

    if __name__ == "__main__":
        method = sys.argv[1]
        if method == "fork":
            import vllm.v1.core.sched.scheduler  # the child inherits the parent's patches
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=probe, args=(q,))
        p.start()
        print(json.dumps(q.get(timeout=60)))
        p.join(30)
""")


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_multiprocessing_children_are_activated(home, tmp_path, method):
    import subprocess
    import sys

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = clean_env(PYTHONPATH=f"{home}:{FAKE_VLLM}")
    proc = subprocess.run([sys.executable, str(script), method], env=env, capture_output=True,
                          text=True, timeout=120, cwd=NEUTRAL_CWD)
    assert last_json(proc) == ["sitecustomize", True]


def test_concurrent_imports_of_hooked_and_plain_modules_finish(home):
    code = textwrap.dedent("""
        import json, threading, importlib
        names = ["vllm.v1.core.sched.scheduler", "vllm.distributed.unrelated",
                 "vllm.distributed.connector", "json.decoder"]
        threads = [threading.Thread(target=importlib.import_module, args=(n,)) for n in names]
        for t in threads: t.start()
        for t in threads: t.join(timeout=30)
        import vllm.v1.core.sched.scheduler as s
        print(json.dumps([any(t.is_alive() for t in threads),
                          hasattr(vars(s.Scheduler)["_update_from_kv_xfer_finished"], "__wrapped__")]))
    """)
    assert last_json(run_py(code, path=[home, FAKE_VLLM])) == [False, True]


def test_failing_hook_keeps_the_import_working_and_reverts_the_group(tmp_path):
    home = install_home(tmp_path / "home", entry_wrapper="no_such_wrapper")
    proc = run_py(PROBE, path=[home, FAKE_VLLM])
    out = last_json(proc)
    assert out["entry"] == ["a"]  # connector imported fine, unwrapped
    assert out["survived"] is False  # the scheduler half of the group was reverted
    errors = [line for line in proc.stderr.splitlines() if "hotfix.patch.error" in line]
    assert len(errors) == 1 and "level='error'" in errors[0] and "no_such_wrapper" in errors[0]


def test_failing_hook_raises_under_strict(tmp_path):
    home = install_home(tmp_path / "home", entry_wrapper="no_such_wrapper")
    proc = run_py(PROBE, path=[home, FAKE_VLLM], env=clean_env(HOTFIX_STRICT="1"))
    assert proc.returncode != 0
    assert "ConfigError" in proc.stderr


def test_toggle_off_skips_the_fix(home):
    out = last_json(run_py(PROBE, path=[home, FAKE_VLLM], env=clean_env(HOTFIX_DEMO_GUARD="off")))
    assert out["survived"] is False and out["entry"] == ["a"]


def test_invalid_toggle_logs_one_error_and_uses_the_default(home):
    proc = run_py(PROBE, path=[home, FAKE_VLLM], env=clean_env(HOTFIX_DEMO_GUARD="maybe"))
    assert last_json(proc)["survived"] is True
    lines = [line for line in proc.stderr.splitlines() if "hotfix.config.invalid" in line]
    assert len(lines) == 1
    for needle in ("HOTFIX_DEMO_GUARD", "'maybe'", "'force'", "default"):
        assert needle in lines[0]


def test_plugin_entry_point_alone_activates(tmp_path):
    home = install_home(tmp_path / "home", shim=False)
    code = "from hotfix.plugin import register; register(); register()\n" + PROBE
    out = last_json(run_py(code, path=[home, FAKE_VLLM]))
    assert out["activated_by"] == "vllm_plugin" and out["survived"] is True


def test_kill_switch_also_stops_the_plugin_entry_point(tmp_path):
    home = install_home(tmp_path / "home", shim=False)
    code = "from hotfix.plugin import register; register()\n" + PROBE
    out = last_json(run_py(code, path=[home, FAKE_VLLM], env=clean_env(HOTFIX_DISABLE="1")))
    assert out["activated_by"] is None and out["survived"] is False
    assert [m for m in out["hotfix_modules"] if m.startswith(("wrapt", "structlog"))] == []


def test_plugin_after_sitecustomize_is_a_no_op(home):
    code = PROBE + "\nfrom hotfix.plugin import register; register(); print(json.dumps(hotfix.activated_by))"
    assert last_json(run_py(code, path=[home, FAKE_VLLM])) == "sitecustomize"


def test_status_file_records_what_the_process_applied(home, tmp_path):
    status_dir = tmp_path / "status"
    code = PROBE + "\nimport os; print(json.dumps(os.getpid()))"
    pid = last_json(run_py(code, path=[home, FAKE_VLLM], env=clean_env(HOTFIX_STATUS_DIR=str(status_dir))))
    data = json.loads((status_dir / f"{pid}.json").read_text())
    assert data["fixes"]["demo-guard"]["state"] == "applied"
    assert data["activated_by"] == "sitecustomize"
