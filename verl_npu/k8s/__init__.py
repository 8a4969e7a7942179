"""Kubernetes for multi-node runs: `verl-npu k8s render` (KubeRay RayJob, Volcano Job) and `validate`."""
