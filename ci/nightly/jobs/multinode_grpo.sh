#!/usr/bin/env bash
# Multi-node nightly (KubeRay RayJob, 2 x A3 16 NPUs): GRPO on the small GLM-5-shaped model (config in
# ci/nightly/models/glm5_small) across two nodes: the single-node DSA job's launch with twice the
# batch, EP 8 and rollout TP 8 over 32 NPUs. Run by ci/k8s/rayjob-multinode.yaml through
# ci/nightly/run_job.sh.
# preflight: --chip a3 --model-config ci/nightly/models/glm5_small
set -euo pipefail

DSA_JOB_NNODES=2
DSA_JOB_EXPERT_PARALLEL=8
DSA_JOB_ROLLOUT_TP=8
DSA_JOB_TRAIN_BATCH_SIZE=64
DSA_JOB_EXPERIMENT=multinode_grpo
# shellcheck source=ci/nightly/jobs/dsa_glm5_small.sh
source "${BASH_SOURCE[0]%/*}/dsa_glm5_small.sh"
