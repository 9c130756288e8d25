"""Print the CI matrix: release x fix -> applied / skipped(reason), tests, wall time per leg.

    python3 .ci/matrix_table.py OUT_DIR LEG...

Reads what .ci/leg.sh left in OUT_DIR for each LEG (status-LEG.json, junit-LEG.xml,
times-LEG.txt, result-LEG.txt; summary-LEG.txt, where a leg wrote one, replaces the tests
column: .ci/vllm-unit.sh's stock-vs-hotfix comparison). Below the table, every failed test
of every leg with the first lines of its message: CI shows only the tail of the run's output,
so what failed must be there. Stdlib only. Exit status 1 if a leg failed or left no record.
"""
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def fixes_of(status_text: str | None) -> tuple[str, dict[str, str]]:
    if not status_text:
        return "?", {}
    try:
        status = json.loads(status_text)
    except ValueError:
        return "?", {}
    decisions = {
        f["fix"]: "applied" if f["apply"] else f"skipped({f['reason']})" for f in status.get("fixes", [])
    }
    return (status.get("vllm") or {}).get("version") or "?", decisions


def tests_of(junit_text: str | None) -> str:
    if not junit_text:
        return "no junit"
    root = ET.fromstring(junit_text)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return f"{passed} passed, {total['failures'] + total['errors']} failed, {total['skipped']} skipped"


def failures_of(junit_text: str | None, lines: int = 4) -> list[str]:
    """``test id: the first lines of its failure`` for each failed or erroring test."""
    if not junit_text:
        return []
    found = []
    for case in ET.fromstring(junit_text).iter("testcase"):
        for problem in (*case.findall("failure"), *case.findall("error")):
            text = (problem.get("message") or problem.text or "").strip().splitlines()[:lines]
            found.append(f"{case.get('classname')}::{case.get('name')}: " + " | ".join(t.strip() for t in text))
    return found


def main(out: Path, legs: list[str]) -> int:
    rows = []
    fix_names: list[str] = []
    bad = False
    for leg in legs:
        release, decisions = fixes_of(read(out / f"status-{leg}.json"))
        for name in decisions:
            if name not in fix_names:
                fix_names.append(name)
        times = dict(
            line.split(" ", 1) for line in (read(out / f"times-{leg}.txt") or "").splitlines() if " " in line
        )
        result = (read(out / f"result-{leg}.txt") or "no record").strip()
        bad |= result != "ok"
        summary = (read(out / f"summary-{leg}.txt") or "").strip()  # e.g. vllm-unit's comparison
        rows.append((leg, release, decisions, summary or tests_of(read(out / f"junit-{leg}.xml")),
                     f"{times.get('build', '?')} s", f"{times.get('tests', '?')} s", result))
    header = ["leg", "release", *fix_names, "tests", "venv", "run", "result"]
    table = [header] + [
        [leg, release, *(d.get(f, "-") for f in fix_names), tests, build, run, result]
        for leg, release, d, tests, build, run, result in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print("== release matrix")
    for i, r in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for leg in legs:
        failed = failures_of(read(out / f"junit-{leg}.xml"))
        if failed:
            print(f"== failed in {leg} ({len(failed)})")
            for line in failed[:30]:
                print("  " + line[:600])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
