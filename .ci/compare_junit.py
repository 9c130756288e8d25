"""Compare two pytest junit XML files test by test: stock vLLM vs vLLM with the hotfix.

    python3 .ci/compare_junit.py STOCK.xml HOTFIX.xml [--known FILE] [--summary FILE]

Each test id (pytest's node id, from the xunit1 `file` attribute; `classname::name` without
it) gets one outcome class: passed, failed, error, skipped (xfail counts as skipped), or
absent when the file does not name it; a test that failed and then errored in teardown is
`failed+error`. Every id whose class differs between the two files is a difference, in either
direction: the hotfix must leave every outcome of vLLM's own tests as it is.

--known FILE lists differences that are expected for now, one test id a line (`#` comments,
blank lines ignored). The comparison fails (exit 1) on any difference not listed AND on any
listed id that ran and no longer differs, so the list can only shrink, with the commit that
fixes the cause. Without --known (or with an empty list) every difference fails: the hard gate.
--summary FILE gets one line for the CI matrix table. Exit 2: a file is missing, unreadable or
holds no test. Stdlib only.
"""
import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

KINDS = ("failure", "error", "skipped")
CLASS = {"failure": "failed", "error": "error", "skipped": "skipped"}


def node_id(case: ET.Element) -> str:
    classname, name, file = case.get("classname", ""), case.get("name", ""), case.get("file")
    if file and file.endswith(".py"):
        module = file[:-3].replace("/", ".")
        if classname == module:
            return f"{file}::{name}"
        if classname.startswith(module + "."):
            return f"{file}::{classname[len(module) + 1:].replace('.', '::')}::{name}"
    return f"{classname}::{name}" if classname else name


def outcomes(path: Path) -> dict[str, tuple[str, str]]:
    """{test id: (outcome class, first line of the message of a non-pass)}."""
    root = ET.parse(path).getroot()
    out: dict[str, tuple[str, str]] = {}
    for case in root.iter("testcase"):
        tid = node_id(case)
        found = [CLASS[child.tag] for child in case if child.tag in KINDS]
        message = ""
        for child in case:
            if child.tag in ("failure", "error"):
                message = (child.get("message") or (child.text or "").strip()).splitlines()[0:1]
                message = message[0][:200] if message else ""
                break
        if tid in out:  # the same id twice (e.g. call failed, teardown errored): merge
            found = out[tid][0].split("+") + found
            message = out[tid][1] or message
        names = [c for c in ("failed", "error", "skipped") if c in found]
        if "skipped" in names and len(names) > 1:
            names.remove("skipped")
        out[tid] = ("+".join(names) or "passed", message)
    return out


def tally(res: dict[str, tuple[str, str]]) -> str:
    counts: dict[str, int] = {}
    for cls, _ in res.values():
        key = "failed" if "failed" in cls else "error" if "error" in cls else cls
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped") if counts.get(k))


def read_known(path: Path | None) -> list[str]:
    if path is None or not path.exists():
        return []
    ids = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            ids.append(line)
    return ids


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stock", type=Path)
    ap.add_argument("hotfix", type=Path)
    ap.add_argument("--known", type=Path, help="expected differences, one test id a line")
    ap.add_argument("--summary", type=Path, help="write a one-line summary here")
    args = ap.parse_args(argv)
    try:
        stock, fixed = outcomes(args.stock), outcomes(args.hotfix)
    except (OSError, ET.ParseError) as exc:
        print(f"compare_junit: {exc}", file=sys.stderr)
        return 2
    if not stock or not fixed:
        print(f"compare_junit: no test in {args.stock if not stock else args.hotfix}", file=sys.stderr)
        return 2
    known = read_known(args.known)
    diffs = []
    for tid in sorted(set(stock) | set(fixed)):
        a, b = stock.get(tid, ("absent", "")), fixed.get(tid, ("absent", ""))
        if a[0] != b[0]:
            diffs.append((tid, a[0], b[0], b[1] or a[1]))
    differing = {d[0] for d in diffs}
    unexpected = [d for d in diffs if d[0] not in known]
    # A listed id that ran and no longer differs is stale; one outside this selection is not.
    stale = [tid for tid in known if tid not in differing and (tid in stock or tid in fixed)]

    print(f"   stock:  {len(stock)} tests: {tally(stock)}")
    print(f"   hotfix: {len(fixed)} tests: {tally(fixed)}")
    if diffs:
        print(f"   {len(diffs)} test(s) with a different outcome (stock -> hotfix):")
        for tid, a, b, msg in diffs:
            tag = "known" if tid in known else "NEW"
            print(f"     [{tag}] {tid}: {a} -> {b}" + (f"  | {msg}" if msg else ""))
    else:
        print("   every test has the same outcome stock and with the hotfix")
    for tid in stale:
        print(f"   [STALE] {tid}: listed in {args.known} but its outcome no longer differs;"
              " remove the line")
    ok = not unexpected and not stale
    summary = f"{len(stock)} tests, {len(diffs)} differ"
    if diffs or known:
        summary += f" ({len(diffs) - len(unexpected)} known, {len(unexpected)} new, {len(stale)} stale)"
    if args.summary:
        args.summary.write_text(summary + "\n")
    print(f"   result: {summary}: {'ok' if ok else 'FAILED'}"
          + (f" (known differences: {args.known})" if known else " (hard gate)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
