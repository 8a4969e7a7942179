#!/usr/bin/env bash
# Nightly (A2, 8 NPUs): GRPO on Qwen2.5-0.5B-Instruct with Megatron + vLLM, param and optimizer
# offload, 15 steps (the comparator averages steps 5-14). Run through ci/nightly/run_job.sh.
# Reads the runner's model and raw GSM8K caches (nightly.env); writes only under $WORK_ROOT/<job>.
# preflight: --chip a2 --model-config ci/nightly/models/qwen2_5_0_5b
set -euo pipefail

NIGHTLY_DIR="${BASH_SOURCE[0]%/*}/.."
set -a
# shellcheck source=/dev/null
source "$NIGHTLY_DIR/nightly.env"
set +a
JOB_DIR="$WORK_ROOT/dense_grpo_offload"
MODEL="$MODEL_ROOT/Qwen/Qwen2.5-0.5B-Instruct"
if [[ ! -f "$MODEL/config.json" ]]; then
  echo "dense_grpo_offload.sh: no $MODEL/config.json: the runner's model cache (MODEL_ROOT in ci/nightly/nightly.env)" \
    "must hold Qwen/Qwen2.5-0.5B-Instruct (ci/README.md, runner layout)" >&2
  exit 2
fi
python3 -m verl_npu.ci.gsm8k "$DATASET_ROOT/openai/gsm8k" "$JOB_DIR/gsm8k"

python3 -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer \
    algorithm.adv_estimator=grpo \
    data.train_files="$JOB_DIR/gsm8k/train.parquet" \
    data.val_files="$JOB_DIR/gsm8k/test.parquet" \
    data.train_batch_size=64 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 \
    actor_rollout_ref.actor.megatron.vanilla_mbridge=True \
    actor_rollout_ref.actor.megatron.param_offload=True \
    actor_rollout_ref.actor.megatron.optimizer_offload=True \
    actor_rollout_ref.ref.megatron.vanilla_mbridge=True \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.calculate_log_probs=True \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    trainer.device=npu \
    trainer.nnodes=1 \
    trainer.n_gpus_per_node=8 \
    trainer.logger='["console"]' \
    trainer.project_name=verl_npu_nightly \
    trainer.experiment_name=dense_grpo_offload \
    trainer.total_training_steps=15 \
    trainer.save_freq=-1 \
    trainer.test_freq=-1 \
    trainer.val_before_train=False \
    "$@"
