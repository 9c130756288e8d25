#!/usr/bin/env sh
# `ray start` with the hotfix in the raylet's environment, on every node of the cluster (head:
# `deploy/ray/ray-start.sh --head`; others: `deploy/ray/ray-start.sh --address HEAD:6379`).
# Each vLLM rank is a Ray worker that the raylet starts, and it must *start* with the bundle on
# PYTHONPATH: vLLM copies the driver's environment into a worker only after it is running, too
# late for Python's path and for vLLM's plugin loader. The bundle must be at /opt/vllm-hotfix
# on every node (or set PYTHONPATH below to where it is).
set -eu
here=$(dirname "$0")
set -a
# shellcheck disable=SC1091
. "$here/../hotfix.env"
set +a
exec "${RAY:-ray}" start "$@"
