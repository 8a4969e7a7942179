#!/usr/bin/env bash
# GRPO on GLM-5.2 (model_type glm_moe_dsa, ~744B total / 40B active) with Megatron + vLLM on
# 32 Atlas A3 nodes x 16 NPUs, in the verl-npu A3 image (docker/Dockerfile.a3).
#
# 1. Edit glm5_2.env (paths, cluster shape). 2. Check the launch anywhere, no NPU needed:
#      verl-npu preflight examples/glm5_2/run_glm5_2_grpo_a3.sh
# 3. Start Ray with examples/glm5_2/ray_start.sh (head, then workers); it waits for every NPU and
#    runs an HCCL all-reduce smoke test. 4. On the head node:
#      bash examples/glm5_2/run_glm5_2_grpo_a3.sh trainer.total_training_steps=200
# Extra arguments are Hydra overrides passed to the trainer.
set -euo pipefail

EXAMPLE_DIR="${BASH_SOURCE[0]%/*}"
ENV_FILE="${ENV_FILE:-$EXAMPLE_DIR/glm5_2.env}"
set -a
# shellcheck source=/dev/null
source "$ENV_FILE"
set +a
export VERL_NPU_ENV_FILE="$ENV_FILE"
PYTHON="${PYTHON:-python3}"

# Parallelism (train): 78 layers over PP8 = 9 on the first and last stage, 10 on the six others.
TRAIN_TP=2 TRAIN_PP=8 TRAIN_CP=4 TRAIN_EP=64 TRAIN_ETP=1
FIRST_STAGE_LAYERS=9 LAST_STAGE_LAYERS=9
# Parallelism (rollout): 8 vLLM replicas of TP8 x DP8 with EP64.
ROLLOUT_TP=8 ROLLOUT_DP=8 ROLLOUT_EP=64

MAX_PROMPT_LENGTH=$((24 * 1024))
MAX_RESPONSE_LENGTH=$((8 * 1024))

JEMALLOC="/usr/lib/$(uname -m)-linux-gnu/libjemalloc.so.2"
if [[ -f "$JEMALLOC" ]]; then export LD_PRELOAD="$JEMALLOC${LD_PRELOAD:+:$LD_PRELOAD}"; fi

MEGATRON=actor_rollout_ref.actor.megatron
TRANSFORMER=$MEGATRON.override_transformer_config
ROLLOUT=actor_rollout_ref.rollout
# The rollout's graphs: decode-only full graphs, the mode vllm-ascend's GLM-5.2 guide runs. Graphs read the
# weights where they were captured; the MoE experts keep their storage across verl's weight syncs only with
# fused MC2 off (glm5_2.env pins VLLM_ASCEND_ENABLE_FUSED_MC2=0; preflight fails graphs with it on).
# DSA on Ascend: MindSpeed's four switches go together (use_dsa_absorb: absorbed MLA, the only form the
# fused indexer / sparse attention / KL-loss operators take). No use_fused_rmsnorm / use_fused_swiglu:
# MindSpeed core_r0.18.0 builds TE-NPU's RMSNorm and fused SwiGLU whatever they say (preflight warns).
# DSA takes padded input only: each micro-batch is padded to its own longest sequence, not the mini-batch's
# (verl's default), which would give a 4k sequence the 32k step (bench/results/padded_layout_h200.json).

"$PYTHON" -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$TRAIN_FILES" \
    data.val_files="$VAL_FILES" \
    data.train_batch_size=64 \
    data.max_prompt_length=$MAX_PROMPT_LENGTH \
    data.max_response_length=$MAX_RESPONSE_LENGTH \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.trust_remote_code=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH)) \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.use_precision_aware_optimizer=True \
    actor_rollout_ref.actor.optim.exp_avg_dtype=bf16 \
    actor_rollout_ref.actor.optim.exp_avg_sq_dtype=bf16 \
    actor_rollout_ref.actor.checkpoint.strict=False \
    $MEGATRON.tensor_model_parallel_size=$TRAIN_TP \
    $MEGATRON.pipeline_model_parallel_size=$TRAIN_PP \
    $MEGATRON.context_parallel_size=$TRAIN_CP \
    $MEGATRON.expert_model_parallel_size=$TRAIN_EP \
    $MEGATRON.expert_tensor_parallel_size=$TRAIN_ETP \
    $MEGATRON.sequence_parallel=True \
    $MEGATRON.use_distributed_optimizer=True \
    $MEGATRON.vanilla_mbridge=True \
    $MEGATRON.param_offload=True \
    $MEGATRON.optimizer_offload=True \
    $MEGATRON.use_remove_padding=False \
    $MEGATRON.pad_bshd_to_minibatch_max=False \
    +$TRANSFORMER.num_layers_in_first_pipeline_stage=$FIRST_STAGE_LAYERS \
    +$TRANSFORMER.num_layers_in_last_pipeline_stage=$LAST_STAGE_LAYERS \
    $TRANSFORMER.recompute_granularity=full \
    $TRANSFORMER.recompute_method=uniform \
    $TRANSFORMER.recompute_num_layers=1 \
    +$TRANSFORMER.use_flash_attn=True \
    +$TRANSFORMER.context_parallel_algo=kvallgather_cp_algo \
    +$TRANSFORMER.use_dsa_absorb=True \
    +$TRANSFORMER.use_fused_lightning_indexer=True \
    +$TRANSFORMER.use_fused_sparse_flash_attention=True \
    +$TRANSFORMER.use_fused_lightning_indexer_kl_loss=True \
    actor_rollout_ref.ref.megatron.param_offload=True \
    actor_rollout_ref.ref.megatron.vanilla_mbridge=True \
    actor_rollout_ref.ref.megatron.pad_bshd_to_minibatch_max=False \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=$ROLLOUT_TP \
    actor_rollout_ref.rollout.data_parallel_size=$ROLLOUT_DP \
    actor_rollout_ref.rollout.expert_parallel_size=$ROLLOUT_EP \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.8 \
    actor_rollout_ref.rollout.max_model_len=$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH)) \
    +$ROLLOUT.engine_kwargs.vllm.compilation_config.cudagraph_mode=FULL_DECODE_ONLY \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    trainer.device=npu \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$NPUS_PER_NODE" \
    trainer.logger='["console"]' \
    trainer.project_name=verl_npu_glm5 \
    trainer.experiment_name=glm5_grpo_a3_32n \
    trainer.default_local_dir="$CKPT_DIR" \
    trainer.save_freq=20 \
    trainer.test_freq=-1 \
    trainer.val_before_train=False \
    "$@"
