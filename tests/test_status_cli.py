"""``python -m hotfix status``: truthful, static (no vLLM/torch import), a readiness gate."""
from __future__ import annotations

import json
import shutil
import textwrap

from conftest import FAKE_VLLM, clean_env, install_home, run_py

STATUS = "import sys; from hotfix.cli import main; sys.exit(main(['status', '--json']))"


def status(path, env=None, flags=()):
    proc = run_py(STATUS, path=path, env=env, flags=flags)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def shadow_vllm(dest, source_root, rel, old, new):
    """A vLLM tree holding one target file with one statement changed."""
    target = dest / "vllm" / rel
    target.parent.mkdir(parents=True)
    (dest / "vllm" / "__init__.py").write_text("")
    text = (source_root / "vllm" / rel).read_text()
    assert old in text
    target.write_text(text.replace(old, new, 1))
    return dest


def test_known_shapes_make_the_fix_apply_and_the_gate_pass(home):
    code, report = status([home, FAKE_VLLM])
    assert code == 0 and report["ready"]
    (fix,) = report["fixes"]
    assert fix["apply"] and fix["reason"] == "known_shape" and fix["toggle"] == "HOTFIX_DEMO_GUARD=on"
    actions = {t["target"].split(":")[1]: t["action"] for t in fix["targets"]}
    assert actions == {"Scheduler._update_from_kv_xfer_finished": "wrap",
                       "Connector.get_finished": "leave", "Connector.get_transfer_results": "wrap"}
    assert report["injection"]["sitecustomize"]["ours"] == str(home / "sitecustomize.py")


def test_changed_statement_skips_the_group_and_fails_the_gate(tmp_path):
    rel = "v1/core/sched/scheduler.py"
    shadow = shadow_vllm(tmp_path / "shadow", FAKE_VLLM, rel, "assert req_id in self.requests",
                         "assert req_id in self.requests, req_id")
    shutil.copytree(FAKE_VLLM / "vllm" / "distributed", shadow / "vllm" / "distributed")
    home = install_home(tmp_path / "home")
    code, report = status([home, shadow])
    assert code == 1 and not report["ready"]
    (fix,) = report["fixes"]
    assert not fix["apply"] and fix["reason"] == "fingerprint_mismatch"
    (bad,) = [t for t in fix["targets"] if t["action"] == "unknown"]
    assert bad["target"].endswith("Scheduler._update_from_kv_xfer_finished")
    assert bad["found"] and bad["found"] not in bad["known"] and len(bad["known"]) == 1
    assert "demo-guard: fingerprint_mismatch" in report["problems"]


def test_force_applies_an_unknown_shape(tmp_path):
    rel = "v1/core/sched/scheduler.py"
    shadow = shadow_vllm(tmp_path / "shadow", FAKE_VLLM, rel, "return sorted", "return list")
    shutil.copytree(FAKE_VLLM / "vllm" / "distributed", shadow / "vllm" / "distributed")
    code, report = status([install_home(tmp_path / "home"), shadow],
                          env=clean_env(HOTFIX_DEMO_GUARD="force"))
    assert code == 0 and report["fixes"][0]["reason"] == "forced"


def test_disabled_fix_does_not_fail_the_gate(home):
    code, report = status([home, FAKE_VLLM], env=clean_env(HOTFIX_DEMO_GUARD="off"))
    assert code == 0 and report["fixes"][0]["reason"] == "disabled"


def test_missing_vllm_fails_the_gate(home):
    code, report = status([home], flags=["-S"])  # -S: no site-packages, so no vLLM
    assert report["vllm"]["path"] is None
    assert code == 1 and report["fixes"][0]["reason"] == "vllm_missing"


def test_injection_problems_are_reported(tmp_path):
    home = install_home(tmp_path / "home", shim=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("")
    code, report = status([home, other, FAKE_VLLM], env=clean_env(VLLM_PLUGINS="something_else"))
    inj = report["injection"]
    assert inj["sitecustomize"]["ours"] is None
    assert inj["plugin"]["excluded_by_vllm_plugins"] is True
    assert code == 1 and any(p.startswith("injection:") for p in report["problems"])


def test_sitecustomize_ahead_of_ours_and_chain_are_reported(home, tmp_path):
    ahead, after = tmp_path / "ahead", tmp_path / "after"
    for d in (ahead, after):
        d.mkdir()
        (d / "sitecustomize.py").write_text("")
    _, report = status([ahead, home, after, FAKE_VLLM])
    site = report["injection"]["sitecustomize"]
    assert site["ahead_of_ours"] == [str(ahead / "sitecustomize.py")]
    assert site["chain_loads_next"] == str(after / "sitecustomize.py")


def test_human_output_names_decision_and_targets(home):
    proc = run_py("import sys; from hotfix.cli import main; sys.exit(main(['status']))",
                  path=[home, FAKE_VLLM])
    assert proc.returncode == 0
    assert "[APPLY] demo-guard (HOTFIX_DEMO_GUARD=on): known_shape" in proc.stdout
    assert "Scheduler._update_from_kv_xfer_finished [engine_core]: wrap" in proc.stdout


def test_invalid_toggle_under_strict_exits_2(home):
    proc = run_py(STATUS, path=[home, FAKE_VLLM],
                  env=clean_env(HOTFIX_DEMO_GUARD="maybe", HOTFIX_STRICT="1"))
    assert proc.returncode == 2 and "HOTFIX_DEMO_GUARD='maybe'" in proc.stderr


# --- on the real installed vLLM --------------------------------------------------------

STATUS_AND_IMPORTS = textwrap.dedent("""
    import io, json, sys, contextlib
    from hotfix.cli import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["status", "--json"])
    print(json.dumps([rc, json.loads(buf.getvalue()),
                      sorted(m for m in ("vllm", "torch") if m in sys.modules)]))
""")


def status_and_imports(home):
    """(exit code, JSON report, which of vllm/torch the status command imported)."""
    return json.loads(run_py(STATUS_AND_IMPORTS, path=[home]).stdout.strip().splitlines()[-1])


def test_real_vllm_status_matches_stock_shape_without_importing_vllm_or_torch(tmp_path):
    home = install_home(tmp_path / "home", fixes=("real_probe",))
    rc, report, imported = status_and_imports(home)
    assert imported == []
    assert rc == 0 and report["vllm"]["version"]
    (target,) = report["fixes"][0]["targets"]
    assert target["action"] == "wrap" and target["matches"] in ("0.27.0-0.31.0", "0.32.0-0.33.0", "0.34.0")


def test_real_vllm_file_with_one_statement_changed_is_named_with_both_fingerprints(tmp_path):
    from hotfix import fingerprint

    real_root = fingerprint.package_root("vllm")
    from pathlib import Path

    shadow = shadow_vllm(tmp_path / "shadow", Path(real_root).parent, "v1/core/sched/scheduler.py",
                         "assert req_id in self.requests", "assert req_id in self.requests, req_id")
    home = install_home(tmp_path / "home", fixes=("real_probe",))
    code, report = status([home, shadow])
    assert code == 1
    (target,) = report["fixes"][0]["targets"]
    assert target["action"] == "unknown" and target["found"] not in target["known"]
    proc = run_py("import sys; from hotfix.cli import main; sys.exit(main(['status']))", path=[home, shadow])
    assert "Scheduler._update_from_kv_xfer_finished" in proc.stdout
    assert target["found"] in proc.stdout and all(fp in proc.stdout for fp in target["known"])


def test_real_fixes_report_apply_on_the_installed_vllm_without_importing_it(tmp_path):
    home = install_home(tmp_path / "home", fixes=())
    rc, report, imported = status_and_imports(home)
    assert imported == []
    assert rc == 0, report["problems"]
    decisions = {f["fix"]: (f["apply"], f["reason"]) for f in report["fixes"]}
    release = tuple(int(n) for n in report["vllm"]["version"].split("+")[0].split("."))
    d7 = (True, "known_shape") if release < (0, 30) else (False, "fixed_upstream")  # D7 fixed in 0.30
    assert decisions == {"recv-barrier": (True, "known_shape"), "xfer-guard": (True, "known_shape"),
                         "pull-pin": (True, "known_shape"), "nixl-settle": d7,
                         "lease-guard": (True, "known_shape"), "load-bound": (True, "known_shape"),
                         "hybrid-fail": d7,  # D9: fixed in 0.30 too
                         "peer-reconnect": (True, "known_shape")}
