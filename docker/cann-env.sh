# shellcheck shell=bash
# cann-env.sh - the CANN environment of the verl-npu images, in one place. Sourced, never run:
# docker/entrypoint.sh loads it in every container and install.sh's chip step during the build.
#
# The CANN base images' own entrypoint sources three scripts, in this order, and so does
# cann_env_load (our entrypoint replaces theirs):
#   toolkit       $ASCEND_ROOT/ascend-toolkit/set_env.sh: the CANN toolkit (torch_npu cannot load
#                 libhccl.so without it). It sets ASCEND_TOOLKIT_HOME (/usr/local/Ascend/cann-<version>).
#   ascendnpu-ir  $ASCEND_TOOLKIT_HOME/share/info/ascendnpu-ir/bin/set_env.sh: AscendNPU IR and its
#                 bisheng compiler, which triton-ascend compiles kernels with.
#   atb           $ASCEND_ROOT/nnal/atb/set_env.sh --cxx_abi=$ATB_CXX_ABI: NNAL's Ascend Transformer
#                 Boost library for the C++ ABI of torch (the base image sets ATB_CXX_ABI=1).
# ASCEND_ROOT defaults to /usr/local/Ascend.

CANN_ENV_STEPS=(toolkit ascendnpu-ir atb)
CANN_ENV_SOURCED=() # the scripts cann_env_load sourced, in order

cann_env_script() { # cann_env_script STEP: the script of one step (ascendnpu-ir's after the toolkit's)
  local root="${ASCEND_ROOT:-/usr/local/Ascend}"
  case "$1" in
    toolkit) printf '%s\n' "$root/ascend-toolkit/set_env.sh" ;;
    ascendnpu-ir) printf '%s\n' "${ASCEND_TOOLKIT_HOME:-$root/ascend-toolkit/latest}/share/info/ascendnpu-ir/bin/set_env.sh" ;;
    atb) printf '%s\n' "$root/nnal/atb/set_env.sh" ;;
    *) return 1 ;;
  esac
}

cann_env_load() { # cann_env_load WARN_PREFIX: source the three scripts in order; warn for a missing one
  CANN_ENV_SOURCED=()
  local _cann_env_prefix=$1 _cann_env_trap _cann_env_opts="" _cann_env_step _cann_env_script
  # CANN's scripts read unset variables and may end on a failed test: run them without -e, -u and the
  # ERR trap, then restore the caller's options and trap.
  [[ $- == *e* ]] && _cann_env_opts+=e
  [[ $- == *u* ]] && _cann_env_opts+=u
  _cann_env_trap="$(trap -p ERR)"
  trap - ERR
  set +eu
  set -- # no positional parameters leak into the sourced scripts
  for _cann_env_step in "${CANN_ENV_STEPS[@]}"; do
    _cann_env_script="$(cann_env_script "$_cann_env_step")"
    if [[ ! -f "$_cann_env_script" ]]; then
      printf '%s WARNING: %s not found: %s\n' "$_cann_env_prefix" "$_cann_env_script" "$(cann_env_missing "$_cann_env_step")" >&2
    elif [[ "$_cann_env_step" == atb ]]; then
      # shellcheck source=/dev/null
      source "$_cann_env_script" "--cxx_abi=${ATB_CXX_ABI:-1}"
      CANN_ENV_SOURCED+=("$_cann_env_script --cxx_abi=${ATB_CXX_ABI:-1}")
    else
      # shellcheck source=/dev/null
      source "$_cann_env_script"
      CANN_ENV_SOURCED+=("$_cann_env_script")
    fi
  done
  set +eu
  [[ -z "$_cann_env_opts" ]] || set "-$_cann_env_opts"
  eval "$_cann_env_trap"
  export VERL_NPU_CANN_ENV=loaded # child login shells (docker/profile-cann.sh) need not load it again
  return 0
}

cann_env_missing() { # cann_env_missing STEP: what is lost without the step's script
  case "$1" in
    toolkit) echo "CANN is not set up in this environment; torch_npu cannot load (libhccl.so)" ;;
    ascendnpu-ir) echo "no AscendNPU IR / bisheng toolchain; triton-ascend cannot compile kernels" ;;
    atb) echo "no ATB (NNAL); vllm-ascend's ATB operators cannot load" ;;
  esac
}
