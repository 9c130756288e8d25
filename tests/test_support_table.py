"""`python -m hotfix status --json` on the installed vLLM release equals the support table.

The table is what operators are promised per release (README "Supported vLLM releases"),
written out by hand rather than derived from the fixes' known shapes, so a SPEC edit that
drops a release fails here. CI runs this on every release of the matrix (.ci/run).
"""
from __future__ import annotations

import json

import pytest

from conftest import REPO, clean_env, run_py

FIXES = ("recv-barrier", "xfer-guard", "pull-pin", "nixl-settle", "lease-guard", "load-bound", "hybrid-fail",
         "peer-reconnect")
RELEASES = ("0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
SUPPORT = {release: {fix: "applies" for fix in FIXES} for release in RELEASES}
for _release in ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"):  # D7 and D9 are fixed in vLLM 0.30.0
    SUPPORT[_release]["nixl-settle"] = SUPPORT[_release]["hybrid-fail"] = "fixed_upstream"


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split("."))


def covers(matches: str, release: str) -> bool:
    """`matches` lists a known shape's releases as status prints them:
    "0.27.0-0.31.0", "0.33.0", "0.27.0-0.28.0, 0.30.0-0.33.0", "0.30.0-0.33.0 (note)"."""
    for span in matches.split(" (")[0].split(", "):
        low, _, high = span.partition("-")
        if version(low) <= version(release) <= version(high or low):
            return True
    return False


def installed_status() -> tuple[int, dict]:
    proc = run_py(
        "import sys; from hotfix.cli import main; sys.exit(main(['status', '--json']))",
        path=[REPO], env=clean_env(HOTFIX_DISABLE="1"),
    )
    return proc.returncode, json.loads(proc.stdout)


def test_status_on_the_installed_release_is_its_support_table_row():
    rc, report = installed_status()
    release = report["vllm"]["version"].split("+")[0]
    assert release in SUPPORT, f"vLLM {release} is not in the support table: add its row (and README's)"
    decisions = {f["fix"]: "applies" if f["apply"] and f["reason"] == "known_shape" else f["reason"]
                 for f in report["fixes"]}
    assert decisions == SUPPORT[release]
    assert rc == 0 and report["ready"], report["problems"]
    for fix in report["fixes"]:
        for target in fix["targets"]:
            where = (fix["fix"], target["target"], target["matches"], target["known"])
            if target["action"] == "absent":  # only releases that lack it may lack it
                assert not any(covers(span, release) for span in target["known"].values()), where
            else:
                assert target["action"] in ("wrap", "leave", "fixed"), where
                assert covers(target["matches"], release), where


def readme_support_rows() -> dict[str, dict[str, str]]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Supported vLLM releases", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (cell.strip() for cell in line.strip("|").split("|"))))
        rows[cells["vLLM"]] = {fix: cells[fix] for fix in FIXES}
    return rows


def test_readme_support_table_is_the_tested_table():
    assert readme_support_rows() == SUPPORT


@pytest.mark.parametrize("matches, release, expected", [
    ("0.27.0-0.31.0", "0.31.0", True), ("0.27.0-0.31.0", "0.32.0", False),
    ("0.33.0", "0.33.0", True), ("0.27.0-0.27.1", "0.27.1+cpu", True), ("0.30.0-0.32.0", "0.29.0", False),
    ("0.27.0-0.28.0, 0.30.0-0.33.0", "0.29.0", False), ("0.27.0-0.28.0, 0.30.0-0.33.0", "0.31.0", True),
    ("0.30.0-0.33.0 (delegates to get_transfer_results)", "0.33.0", True),
])
def test_release_range_reading(matches, release, expected):
    assert covers(matches, release) is expected
