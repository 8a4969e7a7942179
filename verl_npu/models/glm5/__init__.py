"""GLM-5 and GLM-5.2 (HF ``model_type`` "glm_moe_dsa"): MLA, MoE and DeepSeek sparse attention, with GLM-5.2's
IndexShare. ``config``: the HF config's mapping to megatron-core and GLM-5.2's indexer layout; ``names``: how a
model path or ``--model-config`` value names the family."""
