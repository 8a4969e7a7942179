#!/usr/bin/env bash
# Entrypoint of the verl-npu images: load the CANN environment, then run the command.
# It replaces the CANN base image's entrypoint and sources the same scripts in the same order
# (docker/cann-env.sh: the toolkit, AscendNPU IR, ATB); torch_npu cannot load without the
# toolkit (libhccl.so) and fails with confusing errors when it is absent.
set -euo pipefail

# shellcheck source=docker/cann-env.sh
source "$(dirname "${BASH_SOURCE[0]}")/cann-env.sh"
cann_env_load "[verl-npu entrypoint]"

exec "$@"
