#!/usr/bin/env sh
# `docker run` of an unmodified vLLM image with the hotfix: the bundle mounted read-only, the
# environment from deploy/hotfix.env, the status records on a named volume. Run the readiness
# gate first (same mounts, same env): it exits 1 when an enabled fix would not apply to the
# vLLM in that image, and then the server is not started.
#   BUNDLE=/opt/vllm-hotfix IMAGE=vllm/vllm-openai:v0.34.0 deploy/docker/run.sh --model M ...
set -eu
here=$(dirname "$0")
BUNDLE=${BUNDLE:-/opt/vllm-hotfix}
IMAGE=${IMAGE:-vllm/vllm-openai:v0.34.0}
DOCKER=${DOCKER:-docker}
hotfix="-v $BUNDLE:/opt/vllm-hotfix:ro -v vllm-hotfix-status:/var/run/vllm-hotfix --env-file $here/../hotfix.env"
# shellcheck disable=SC2086  # $hotfix is a list of options
$DOCKER run --rm $hotfix --entrypoint python3 "$IMAGE" -m hotfix status
# shellcheck disable=SC2086
exec $DOCKER run --gpus all --ipc=host -p 8000:8000 $hotfix "$IMAGE" "$@"
