#!/usr/bin/env bash
# Nightly (A3, 16 NPUs): GRPO on a small GLM-5-shaped model (MLA + DSA + MoE; config in
# ci/nightly/models/glm5_small with its small tokenizer, random weights made by make_glm5_small.py) with
# MindSpeed's absorbed MLA and fused DSA operators, EP and offload. Run through ci/nightly/run_job.sh.
# Reads the runner's raw GSM8K cache (nightly.env); writes the model and the data under $WORK_ROOT/<experiment>,
# or DSA_JOB_DIR when set: over several nodes every worker reads them, so they must be on storage all mount.
# multinode_grpo.sh sets the DSA_JOB_* values below (nodes, EP, rollout TP, batch, experiment) and
# sources this file: one launch for both jobs.
# preflight: --chip a3 --model-config ci/nightly/models/glm5_small
set -euo pipefail

NIGHTLY_DIR="${BASH_SOURCE[0]%/*}/.."
set -a
# shellcheck source=/dev/null
source "$NIGHTLY_DIR/nightly.env"
set +a
JOB_DIR="${DSA_JOB_DIR:-$WORK_ROOT/${DSA_JOB_EXPERIMENT:-dsa_glm5_small}}"
MODEL_DIR="$JOB_DIR/model"
python3 "$NIGHTLY_DIR/make_glm5_small.py" "$NIGHTLY_DIR/models/glm5_small" "$MODEL_DIR"
python3 -m verl_npu.ci.gsm8k "$DATASET_ROOT/openai/gsm8k" "$JOB_DIR/gsm8k"

MEGATRON=actor_rollout_ref.actor.megatron
TRANSFORMER=$MEGATRON.override_transformer_config

python3 -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer \
    algorithm.adv_estimator=grpo \
    data.train_files="$JOB_DIR/gsm8k/train.parquet" \
    data.val_files="$JOB_DIR/gsm8k/test.parquet" \
    data.train_batch_size="${DSA_JOB_TRAIN_BATCH_SIZE:-32}" \
    data.max_prompt_length=1024 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path="$MODEL_DIR" \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    $MEGATRON.tensor_model_parallel_size=2 \
    $MEGATRON.pipeline_model_parallel_size=2 \
    $MEGATRON.expert_model_parallel_size="${DSA_JOB_EXPERT_PARALLEL:-4}" \
    $MEGATRON.sequence_parallel=True \
    $MEGATRON.use_remove_padding=False \
    $MEGATRON.vanilla_mbridge=True \
    $MEGATRON.param_offload=True \
    $MEGATRON.optimizer_offload=True \
    +$TRANSFORMER.use_flash_attn=True \
    +$TRANSFORMER.use_dsa_absorb=True \
    +$TRANSFORMER.use_fused_lightning_indexer=True \
    +$TRANSFORMER.use_fused_sparse_flash_attention=True \
    +$TRANSFORMER.use_fused_lightning_indexer_kl_loss=True \
    actor_rollout_ref.ref.megatron.vanilla_mbridge=True \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.calculate_log_probs=True \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.tensor_model_parallel_size="${DSA_JOB_ROLLOUT_TP:-4}" \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.max_model_len=2048 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    trainer.device=npu \
    trainer.nnodes="${DSA_JOB_NNODES:-1}" \
    trainer.n_gpus_per_node=16 \
    trainer.logger='["console"]' \
    trainer.project_name=verl_npu_nightly \
    trainer.experiment_name="${DSA_JOB_EXPERIMENT:-dsa_glm5_small}" \
    trainer.total_training_steps=15 \
    trainer.save_freq=-1 \
    trainer.test_freq=-1 \
    trainer.val_before_train=False \
    "$@"
