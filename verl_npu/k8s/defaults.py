"""The rendered manifests' defaults that the command line shows in its help (no imports: the CLI starts fast).

Where each value comes from is in ci/k8s/README.md ("Requests, limits and the host RAM check", "Host paths").
"""

# The device plugin's resource name. Huawei Cloud CCE's Ascend plugin, which upstream verl's and
# vllm-ascend's A3 multi-node nightlies run on, names 910B and 910C `huawei.com/ascend-1980`;
# MindCluster's device plugin names them `huawei.com/Ascend910` (pass --npu-resource).
DEFAULT_NPU_RESOURCE = "huawei.com/ascend-1980"
DEFAULT_VOLUMES = (("verl-npu-cache", "/root/.cache"),)
DEFAULT_PULL_SECRET = "verl-npu-registry"

# Each node pod's requests (= limits), as upstream verl's multi-node RayJob asks of the same CCE A3 nodes: pods
# that ask more than a node's allocatable CPU or memory never schedule. The host RAM a launch needs is checked
# against MEMORY less SHM_SIZE at render time (preflight's estimate), so a launch that needs more says so there.
DEFAULT_CPU = "64"
DEFAULT_MEMORY = "512Gi"
DEFAULT_SHM_SIZE = "128Gi"  # memory-backed: charged to DEFAULT_MEMORY as it fills

# The host side of the NPUs that verl's rollout and `verl-npu doctor` call (driver libraries and tools, DCMI,
# npu-smi), at the paths the Ascend Docker Runtime mounts into NPU containers by default. Each is mounted read-only
# with its hostPath type, so a node without it fails the pod's start naming the path, instead of the container
# runtime creating an empty directory where a file was expected.
DEFAULT_HOST_DIRECTORIES = ("/usr/local/Ascend/driver", "/usr/local/dcmi")
DEFAULT_HOST_FILES = ("/usr/local/bin/npu-smi",)

# The most node pods a render writes and `k8s validate` passes (--max-nodes): each pod holds a whole node's NPUs,
# so a job has at most as many pods as the cluster has nodes, and Kubernetes supports clusters of at most 5,000
# nodes (its documentation, "Considerations for large clusters"; docs/errors.md). A site lowers it to its own size.
DEFAULT_MAX_NODES = 5000
MAX_NODES_LIMIT = 100_000  # --max-nodes itself: pod hostnames <job>-worker-<index> leave room for 5 digits
