# shellcheck shell=bash
# /etc/profile.d/verl-npu-cann.sh in the verl-npu images: login shells load the CANN environment.
# CI runners start each step as `bash -el {0}` in a container whose command they chose, so the image's
# entrypoint (docker/entrypoint.sh) never ran there; the login shell reads /etc/profile.d instead.
# A shell started by the entrypoint has it already (VERL_NPU_CANN_ENV), and a non-bash shell skips it.
[ -n "${BASH_VERSION:-}" ] || return 0
if [[ -z "${VERL_NPU_CANN_ENV:-}" ]]; then
  # shellcheck source=docker/cann-env.sh
  source "${VERL_NPU_SRC:-/opt/verl-npu/src/verl-npu}/docker/cann-env.sh"
  cann_env_load "[verl-npu login shell]"
fi
