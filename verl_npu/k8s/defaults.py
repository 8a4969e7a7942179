"""The rendered manifests' defaults that the command line shows in its help (no imports: the CLI starts fast)."""

# The device plugin's resource name. Huawei Cloud CCE's Ascend plugin, which upstream verl's and
# vllm-ascend's A3 multi-node nightlies run on, names 910B and 910C `huawei.com/ascend-1980`;
# MindCluster's device plugin names them `huawei.com/Ascend910` (pass --npu-resource).
DEFAULT_NPU_RESOURCE = "huawei.com/ascend-1980"
DEFAULT_VOLUMES = (("verl-npu-cache", "/root/.cache"),)
DEFAULT_PULL_SECRET = "verl-npu-registry"
# The host side of the NPUs, as the Ascend runners' pod template mounts it (ci/nightly/check_npus.sh):
# the driver's libraries, DCMI and npu-smi, which verl's rollout and `verl-npu doctor` call.
DEFAULT_HOST_PATHS = ("/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/sbin/npu-smi")
