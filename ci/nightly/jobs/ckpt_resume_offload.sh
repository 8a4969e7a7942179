#!/usr/bin/env bash
# Nightly (A2, 8 NPUs): checkpoint save and resume under param/optimizer offload with the
# precision-aware optimizer (bf16 moments). Trains 8 steps saving at step 8, then resumes from it
# to step 15 in a new run; the comparator checks steps 5-14 across both logs (run_job.sh joins them).
# Reads the runner's model and raw GSM8K caches (nightly.env); writes only under $WORK_ROOT/<job>.
# preflight: --chip a2 --model-config ci/nightly/models/qwen2_5_0_5b
set -euo pipefail

NIGHTLY_DIR="${BASH_SOURCE[0]%/*}/.."
set -a
# shellcheck source=/dev/null
source "$NIGHTLY_DIR/nightly.env"
set +a
JOB_DIR="$WORK_ROOT/ckpt_resume_offload"
MODEL="$MODEL_ROOT/Qwen/Qwen2.5-0.5B-Instruct"
if [[ ! -f "$MODEL/config.json" ]]; then
  echo "ckpt_resume_offload.sh: no $MODEL/config.json: the runner's model cache (MODEL_ROOT in ci/nightly/nightly.env)" \
    "must hold Qwen/Qwen2.5-0.5B-Instruct (ci/README.md, runner layout)" >&2
  exit 2
fi
python3 -m verl_npu.ci.gsm8k "$DATASET_ROOT/openai/gsm8k" "$JOB_DIR/gsm8k"
STEPS="${STEPS:-15}"
MEGATRON=actor_rollout_ref.actor.megatron

python3 -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer \
    algorithm.adv_estimator=grpo \
    data.train_files="$JOB_DIR/gsm8k/train.parquet" \
    data.val_files="$JOB_DIR/gsm8k/test.parquet" \
    data.train_batch_size=32 \
    data.max_prompt_length=512 \
    data.max_response_length=512 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.use_precision_aware_optimizer=True \
    actor_rollout_ref.actor.optim.exp_avg_dtype=bf16 \
    actor_rollout_ref.actor.optim.exp_avg_sq_dtype=bf16 \
    actor_rollout_ref.actor.checkpoint.strict=False \
    $MEGATRON.tensor_model_parallel_size=2 \
    $MEGATRON.use_distributed_optimizer=True \
    $MEGATRON.vanilla_mbridge=True \
    $MEGATRON.param_offload=True \
    $MEGATRON.optimizer_offload=True \
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
    trainer.experiment_name=ckpt_resume_offload \
    trainer.default_local_dir="$JOB_DIR/checkpoints" \
    trainer.total_training_steps="$STEPS" \
    trainer.save_freq=8 \
    trainer.resume_mode=auto \
    trainer.test_freq=-1 \
    trainer.val_before_train=False \
    "$@"
