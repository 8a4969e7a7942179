"""Forward the verl-npu layer and Ascend variables to every Ray worker.

Changes: wraps ``verl.trainer.constants_ppo.get_ppo_ray_runtime_env`` so that the runtime env it
returns also carries ``VERL_USE_EXTERNAL_MODULES``, verl-npu's own switches, verl's GLM-5.2 rollout
switch and the HCCL / determinism variables of the launching shell (only those that are set), plus every variable
defined in the env file named by ``VERL_NPU_ENV_FILE`` (a cluster's one env file, see
examples/glm5_2), with the launching shell's value where it has one.
Why: verl 0.9.1 forwards neither. Workers on other nodes inherit the environment of their
node's raylet, not of the driver, so they would run without the NPU layer or with different
HCCL timeouts and determinism settings than the driver asked for, and vLLM rollout workers
without ``VERL_VLLM_ASCEND_GLM52_PATCH`` (verl's opt-in vllm-ascend 0.23 fixes for GLM-5.2 weight
updates, read where the rollout starts: contracts in verl_npu/contracts). PYTORCH_NPU_ALLOC_CONF is not
forwarded: expandable segments stop vLLM's sleep mode (contract
vllm-ascend-sleep-mode-refuses-expandable-segments), and the workers' allocator settings are the
node's. Nor are the host interface variables (NODE_LOCAL_VARIABLES), even when the env file or
the driver's shell has them: interface names differ between nodes, and each node's
``ray_start.sh`` exports its own (verl_npu/cluster/network.py) before ``ray start``, so the
workers inherit their node's value from the raylet; the driver's would override it.
Upstream: verl 0.9.1 verl/trainer/constants_ppo.py (get_ppo_ray_runtime_env).
Remove when: verl forwards VERL_USE_EXTERNAL_MODULES, its GLM-5.2 switch and the HCCL variables itself.
"""

from __future__ import annotations

import functools
import os

from verl_npu.envfile import env_file_variables  # re-exported: the reader moved to a torch-free module
from verl_npu.patching import Patch
from verl_npu.runtime_patches._targets import EVERY_PLATFORM

FORWARDED_VARIABLES = (
    "VERL_USE_EXTERNAL_MODULES",
    "VERL_NPU_ALLOW_MISMATCH",
    "VERL_NPU_TARGET",
    "VERL_NPU_BUILD_MANIFEST",
    "VERL_NPU_PLATFORM",
    "VERL_NPU_ENV_FILE",
    "HCCL_DETERMINISTIC",
    "CLOSE_MATMUL_K_SHIFT",
    "HCCL_CONNECT_TIMEOUT",
    "HCCL_EXEC_TIMEOUT",
    "HCCL_BUFFSIZE",
    "HCCL_IF_BASE_PORT",
    "ASCEND_LAUNCH_BLOCKING",
    "VERL_VLLM_ASCEND_GLM52_PATCH",
)

# Per node by nature: an interface name or an address of the node the worker runs on.
NODE_LOCAL_VARIABLES = frozenset({"HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "HCCL_IF_IP"})


def _build(original):
    @functools.wraps(original)
    def get_ppo_ray_runtime_env(*args, **kwargs):
        runtime_env = original(*args, **kwargs)
        env_vars = runtime_env.setdefault("env_vars", {})
        for name in FORWARDED_VARIABLES:
            value = os.environ.get(name)
            if value is not None:
                env_vars.setdefault(name, value)
        env_file = os.environ.get("VERL_NPU_ENV_FILE")
        if env_file:
            for name, value in env_file_variables(env_file).items():
                if name not in NODE_LOCAL_VARIABLES:
                    env_vars.setdefault(name, os.environ.get(name, value))
        return runtime_env

    return get_ppo_ray_runtime_env


PATCH = Patch(
    id="ray-runtime-env-forwarding",
    target="verl.trainer.constants_ppo:get_ppo_ray_runtime_env",
    kind="wrap",
    platforms=EVERY_PLATFORM,
    requires={"verl": "==0.9.1"},
    source_sha256="ed578af6fe2ba5c7824be0b4300ce6f1efbeed9cc7218da98bbf8e173798437c",
    reason="verl's Ray runtime env drops VERL_USE_EXTERNAL_MODULES and the HCCL/determinism variables, "
    "so workers on other nodes run without the NPU layer",
    upstream="verl 0.9.1 verl/trainer/constants_ppo.py::get_ppo_ray_runtime_env",
    remove_when="verl forwards VERL_USE_EXTERNAL_MODULES and HCCL_* variables to Ray workers",
    build=_build,
)
PATCHES = (PATCH,)
