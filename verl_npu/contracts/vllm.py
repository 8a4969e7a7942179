"""What verl-npu relies on in vLLM 0.23.0 (the version pinned in verl_npu/stack/stack.toml, ``git.vllm``).

Two groups of facts:

* How vLLM loads GLM-5 weights: verl streams the GLM-5 bridge's ``export_weights()`` (HF names and
  layouts) into the rollout's ``load_weights`` after every training step. vLLM's GLM-5 model is
  ``deepseek_v2``'s; its loader renames a few checkpoint tensors onto fused parameters, skips MTP
  layers and rotary buffers, and raises KeyError for a name it has no parameter for. With verl's
  ``load_format: dummy`` a parameter never sent stays random, and nothing checks completeness, so the
  export must name exactly the parameters vLLM (with vllm-ascend's GLM-5 patch, see
  verl_npu/contracts/vllm_ascend.py) builds. The constants below are those facts, kept for drift;
  tests_npu/engine/test_vllm_load_weights.py executes the load itself (vLLM and vllm-ascend from their sdists,
  verl's sync code) and checks these facts against the model vLLM builds there.
* The vLLM engine-core methods verl 0.9.1's GLM-5.2 rollout patch (``VERL_VLLM_ASCEND_GLM52_PATCH``,
  verl/utils/vllm/npu_vllm_patch.py) checks and replaces: it raises only when the rollout starts, so
  its checks are recorded here (whitespace ignored, as verl compares them) and verified at image
  build and by ``verl-npu doctor``.
"""

from __future__ import annotations

from typing import Any

from verl_npu.contracts.spec import Contract, Expect

_DEEPSEEK_V2 = "vllm/model_executor/models/deepseek_v2.py"
_ENGINE_CORE = "vllm/v1/engine/core.py"
_KV_CACHE_UTILS = "vllm/v1/core/kv_cache_utils.py"
_ROUTES_CAPTURER = "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py"

# DeepseekV2Model.load_weights: (vLLM parameter, checkpoint name part, shard), tried in this order
# on every name that is not a routed expert's; the first whose part is in the name renames it.
STACKED_PARAMETERS = (
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
    ("wk_weights_proj", "wk", 0),
    ("wk_weights_proj", "weights_proj", 1),
    ("fused_qkv_a_proj", "q_a_proj", 0),
    ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1),
)
# FusedMoE.make_expert_params_mapping: checkpoint ``experts.<id>.<proj>.`` -> FusedMoE's parameter prefix.
EXPERT_PARAMETERS = {"gate_proj": "experts.w13_", "up_proj": "experts.w13_", "down_proj": "experts.w2_"}
# Checkpoint names DeepseekV2Model.load_weights drops without looking for a parameter.
SKIPPED_SUBSTRINGS = ("rotary_emb.inv_freq",)
# The parameters of an Indexer (vLLM fuses wk and weights_proj into one).
INDEXER_PARAMETERS = ("wq_b.weight", "wk_weights_proj.weight", "k_norm.weight", "k_norm.bias")
# DeepseekV2MoE: the router (with its score-correction bias only for topk_method "noaux_tc"), the
# shared experts (an MLP) and FusedMoE's routed experts.
ROUTER_BIAS_TOPK_METHOD = "noaux_tc"
MOE_PARAMETERS = ("gate.weight", "experts.w13_weight", "experts.w2_weight")
MLP_PARAMETERS = ("gate_up_proj.weight", "down_proj.weight")
DECODER_LAYER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
MODEL_PARAMETERS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def moe_layers(hf_config: Any) -> tuple[int, ...] | None:
    """The decoder layers vLLM builds as MoE (contract vllm-deepseek-v2-moe-layers), or None when the config has
    no ``first_k_dense_replace``, which vLLM 0.23.0 reads without a default (it cannot build the model)."""
    first_dense = getattr(hf_config, "first_k_dense_replace", None)
    if first_dense is None:
        return None
    if getattr(hf_config, "n_routed_experts", None) is None:
        return ()
    freq = getattr(hf_config, "moe_layer_freq", 1)
    return tuple(i for i in range(hf_config.num_hidden_layers) if i >= first_dense and i % freq == 0)


CONTRACTS = (
    # --- GLM-5's weights in the rollout ---------------------------------------------------------------------
    Contract(
        id="vllm-glm5-is-deepseek-v2",
        component="vllm",
        path="vllm/model_executor/models/registry.py",
        locator="grep",
        symbol="GlmMoeDsa",
        line=0,
        sha256="f2a9fa24a5845fb7e0dbdbee5c0e83c5479ba5e4243159ca102dbebdf120560c",
        relied_on="vLLM builds GlmMoeDsaForCausalLM (GLM-5, GLM-5.2) from deepseek_v2.py",
        used_by="verl_npu/engine/bridges/glm5.py (export_weights), tests_npu/engine/test_vllm_load_weights.py",
        expects=(Expect('"GlmMoeDsaForCausalLM": ("deepseek_v2", "GlmMoeDsaForCausalLM"),', "GLM-5's vLLM module"),),
    ),
    Contract(
        id="vllm-glm5-model-is-deepseek-v2s",
        component="vllm",
        path=_DEEPSEEK_V2,
        locator="python",
        symbol="GlmMoeDsaForCausalLM",
        line=1750,
        sha256="1339cc95fc89de2e96b12a8b7334d23a12272d7883196d58c614bfefc996f1db",
        relied_on="GlmMoeDsaForCausalLM is DeepseekV2ForCausalLM unchanged (same parameters, same load_weights)",
        used_by="tests_npu/engine/test_vllm_load_weights.py",
        expects=(
            Expect("class GlmMoeDsaForCausalLM(DeepseekV2ForCausalLM):\n    pass", "a subclass that adds nothing"),
        ),
    ),
    Contract(
        id="vllm-deepseek-v2-loads-through-auto-weights-loader",
        component="vllm",
        path=_DEEPSEEK_V2,
        locator="python",
        symbol="DeepseekV2ForCausalLM.load_weights",
        line=1737,
        sha256="4a009663e5f4844fef42c1ce67b4525bd03d32c62cc0f73bb015a9f9307e82e5",
        relied_on="DeepseekV2ForCausalLM.load_weights hands every name to AutoWeightsLoader without skip prefixes: "
        "model.* goes to DeepseekV2Model.load_weights, lm_head.weight to the head",
        used_by="tests_npu/engine/test_vllm_load_weights.py",
        expects=(Expect("loader = AutoWeightsLoader(self)\n", "no names skipped at the top level"),),
    ),
    Contract(
        id="vllm-deepseek-v2-weight-names",
        component="vllm",
        path=_DEEPSEEK_V2,
        locator="python",
        symbol="DeepseekV2Model.load_weights",
        line=1344,
        sha256="ba50c7830d0115e0a61ee55e489675e0610f37cbfe16c785927a7d48b00959f2",
        relied_on="DeepseekV2Model.load_weights renames gate_proj/up_proj -> gate_up_proj, indexer wk/weights_proj -> "
        "wk_weights_proj and q_a_proj/kv_a_proj_with_mqa -> fused_qkv_a_proj (STACKED_PARAMETERS), routes "
        "experts.<id>.<proj> through FusedMoE's mapping, skips rotary_emb.inv_freq and MTP layers, and looks every "
        "other name up in its parameters: a name with no parameter raises KeyError; nothing checks that every "
        "parameter was loaded",
        used_by="verl_npu/contracts/vllm.py (STACKED_PARAMETERS, SKIPPED_SUBSTRINGS), "
        "tests_npu/engine/test_vllm_load_weights.py",
        expects=(
            Expect(
                '("gate_up_proj", "gate_proj", 0),\n            ("gate_up_proj", "up_proj", 1),', "dense MLP fusion"
            ),
            Expect(
                '("wk_weights_proj", "wk", 0),\n            ("wk_weights_proj", "weights_proj", 1),', "indexer fusion"
            ),
            Expect(
                '("fused_qkv_a_proj", "q_a_proj", 0),\n            ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1),',
                "MLA down-projection fusion",
            ),
            Expect("stacked_params_mapping.extend(indexer_fused_mapping)", "indexer fusion is tried before MLA's"),
            Expect('if "rotary_emb.inv_freq" in name:\n                continue', "rotary buffers skipped"),
            Expect(
                "spec_layer = get_spec_layer_idx_from_weight_name(self.config, name)\n            if spec_layer is not "
                "None:\n                continue",
                "MTP layers skipped",
            ),
            Expect('ckpt_gate_proj_name="gate_proj",', "routed experts named like the checkpoint"),
            Expect("param = params_dict[name]", "an unknown name raises KeyError"),
        ),
    ),
    Contract(
        id="vllm-deepseek-v2-mtp-layers-follow-the-decoder",
        component="vllm",
        path=_DEEPSEEK_V2,
        locator="python",
        symbol="get_spec_layer_idx_from_weight_name",
        line=1756,
        sha256="d26c81170418e5c9831df59a5b999f09939d1cb8273e24fac4beea5bd15a4927",
        relied_on="MTP (spec-decode) layers are checkpoint layers num_hidden_layers .. num_hidden_layers + "
        "num_nextn_predict_layers - 1, which the main model's loader skips",
        used_by="verl_npu/engine/bridges/glm5.py (MTP not built), tests_npu/engine/test_vllm_load_weights.py",
        expects=(
            Expect("layer_idx = config.num_hidden_layers", "MTP layers start after the decoder"),
            Expect("for i in range(config.num_nextn_predict_layers):", "one per num_nextn_predict_layers"),
            Expect('weight_name.startswith(\n                f"model.layers.{layer_idx + i}."', "by checkpoint name"),
        ),
    ),
    Contract(
        id="vllm-mla-latent-norms-use-rms-norm-eps",
        component="vllm",
        path=_DEEPSEEK_V2,
        locator="python",
        symbol="DeepseekV2MLAAttention.__init__",
        line=887,
        sha256="e37cd7a6141fc2eb7a7dac6e828864ad7c24a9a5272adb794c920551d35f4310",
        relied_on="the rollout's MLA latent norms (q_a_layernorm, kv_a_layernorm) are RMSNorms with the config's "
        "rms_norm_eps (1e-5 for GLM-5.2), which the engine's q_layernorm / kv_layernorm follow; transformers' "
        "GlmMoeDsa builds them with 1e-6 instead",
        used_by="verl_npu/engine/bridges/glm5.py (layernorm_epsilon), verl_npu/parity/independent.py (the latent "
        "norms' eps), tests_npu/parity/test_parity_independent.py, docs/parity.md",
        expects=(
            Expect("self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)", "q latent: rms_norm_eps"),
            Expect(
                "self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)", "kv latent: rms_norm_eps"
            ),
        ),
    ),
    Contract(
        id="vllm-deepseek-v2-moe-layers",
        component="vllm",
        path=_DEEPSEEK_V2,
        locator="python",
        symbol="DeepseekV2DecoderLayer.__init__",
        line=1086,
        sha256="9c56124d53da44b65eb88c2e923c3fb14795cf46a5919cf21bd49dce483d8894",
        relied_on="a layer is MoE when n_routed_experts is set, layer_idx >= first_k_dense_replace and layer_idx % "
        "moe_layer_freq == 0 (vLLM does not read mlp_layer_types, which the bridge follows); every layer has "
        "input_layernorm and post_attention_layernorm",
        used_by="tests_npu/engine/test_vllm_load_weights.py (vLLM's parameters of the tiny GLM-5.2)",
        expects=(
            Expect('moe_layer_freq = getattr(config, "moe_layer_freq", 1)', "MoE frequency, default 1"),
            Expect("and layer_idx >= config.first_k_dense_replace", "dense layers come first"),
            Expect("and layer_idx % moe_layer_freq == 0", "then every moe_layer_freq-th layer"),
            Expect("self.input_layernorm = RMSNorm(", "input norm"),
            Expect("self.post_attention_layernorm = RMSNorm(", "post-attention norm"),
        ),
    ),
    Contract(
        id="vllm-deepseek-v2-moe-parameters",
        component="vllm",
        path=_DEEPSEEK_V2,
        locator="python",
        symbol="DeepseekV2MoE.__init__",
        line=247,
        sha256="8932578f903a23695b9a72c51114e8ccfe4c2be955af2a1c96646e2c5d98910f",
        relied_on="DeepseekV2MoE has a router gate, a gate.e_score_correction_bias parameter only when topk_method is "
        "'noaux_tc' (GLM-5's config says so; without it the bridge's exported bias has no parameter), shared experts "
        "(an MLP) when n_shared_experts is set, and FusedMoE's routed experts",
        used_by="verl_npu/contracts/vllm.py (MOE_PARAMETERS), tests_npu/engine/test_vllm_load_weights.py",
        expects=(
            Expect('if getattr(config, "topk_method", None) == "noaux_tc":', "the bias exists only for noaux_tc"),
            Expect("self.gate.e_score_correction_bias = nn.Parameter(", "a parameter, loaded by name"),
            Expect('prefix=f"{prefix}.shared_experts",', "shared experts"),
            Expect("self.experts = FusedMoE(", "routed experts"),
        ),
    ),
    Contract(
        id="vllm-fused-moe-expert-names",
        component="vllm",
        path="vllm/model_executor/layers/fused_moe/layer.py",
        locator="python",
        symbol="FusedMoE.make_expert_params_mapping",
        line=1337,
        sha256="0d48c32e33f58698ebccbb6a5a6392bddb3ee4e0f9d500af2475af34b0aa9d27",
        relied_on="checkpoint experts.<id>.gate_proj / up_proj load into FusedMoE's experts.w13_*, down_proj into "
        "experts.w2_* (EXPERT_PARAMETERS)",
        used_by="verl_npu/contracts/vllm.py (EXPERT_PARAMETERS), tests_npu/engine/test_vllm_load_weights.py",
        expects=(
            Expect('f"experts.{base_layer}w13_"', "gate and up projections load into w13"),
            Expect(
                "if weight_name in [ckpt_gate_proj_name, ckpt_up_proj_name]", "gate and up projections load into w13"
            ),
            Expect('else f"experts.{base_layer}w2_",', "the down projection loads into w2"),
            Expect('f"experts.{physical_to_logical_map[expert_id]}.{weight_name}.{base_layer}",', "per expert id"),
        ),
    ),
    Contract(
        id="vllm-deepseek-v2-indexer-parameters",
        component="vllm",
        path=_DEEPSEEK_V2,
        locator="python",
        symbol="Indexer.__init__",
        line=604,
        sha256="8be8150c5ccc29442046c3078dc1c101690b3dcde4fb0212a980245373f1fced",
        relied_on="an Indexer holds wq_b, wk_weights_proj (wk and weights_proj fused) and k_norm (a LayerNorm with "
        "weight and bias, eps 1e-6)",
        used_by="verl_npu/contracts/vllm.py (INDEXER_PARAMETERS), verl_npu/engine/index_share.py (k_norm eps 1e-6), "
        "tests_npu/engine/test_vllm_load_weights.py",
        expects=(
            Expect("self.wq_b = ReplicatedLinear(", "wq_b"),
            Expect("self.wk_weights_proj = MergedColumnParallelLinear(", "wk and weights_proj fused"),
            Expect("self.k_norm = LayerNorm(self.head_dim, eps=1e-6)", "k_norm: LayerNorm, eps 1e-6"),
        ),
    ),
    # --- verl 0.9.1's GLM-5.2 rollout patch (VERL_VLLM_ASCEND_GLM52_PATCH=1) --------------------------------
    Contract(
        id="vllm-engine-core-wake-up-resumes-scheduling",
        component="vllm",
        path=_ENGINE_CORE,
        locator="python",
        symbol="EngineCore.wake_up",
        line=765,
        sha256="34b1a61819034ee796721a0b974f66c67ddb2e0323ce31d16fbd8f3b16ff235f",
        relied_on="EngineCore.wake_up(self, tags) drops the 'scheduling' tag, wakes the executor and always resumes "
        "the scheduler, also after a partial wake-up (weights only) while the KV cache still sleeps; verl's GLM-5.2 "
        "patch checks exactly this source and resumes only once the executor is fully awake",
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (patch_vllm_glm52_partial_wake_up), enabled by "
        "examples/glm5_2/glm5_2.env",
        expects=(
            Expect("def wake_up(self, tags: list[str] | None = None):", "the signature verl checks: (self, tags)"),
            Expect('tags = [t for t in tags if t != "scheduling"]', "drops the scheduling tag", ignore_whitespace=True),
            Expect(
                "if tags is None or tags:\n            self.model_executor.wake_up(tags)",
                "wakes the executor",
                ignore_whitespace=True,
            ),
            Expect("self.resume_scheduler()", "resumes the scheduler last", match="ends-with", ignore_whitespace=True),
            Expect(
                "if not self.model_executor.is_sleeping:\n            self.resume_scheduler()",
                "the fix (vLLM 6f1ada0f91) is not upstream at our pin: verl's patch applies it",
                present=False,
                ignore_whitespace=True,
            ),
        ),
    ),
    Contract(
        id="vllm-executor-partial-wake-up-keeps-sleeping",
        component="vllm",
        path="vllm/v1/executor/abstract.py",
        locator="python",
        symbol="Executor.wake_up",
        line=331,
        sha256="2c70fd074fc10ad19818e3e442e987574568fb5d4b20d7c6e79e006e0f8f35b0",
        relied_on="the executor stays is_sleeping until every sleeping tag (weights, kv_cache) is awake, which is what "
        "verl's GLM-5.2 patch tests before resuming the scheduler or running a dummy batch",
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (patch_vllm_glm52_partial_wake_up)",
        expects=(
            Expect("if not self.sleeping_tags:\n            self.is_sleeping = False", "awake only when all tags are"),
        ),
    ),
    Contract(
        id="vllm-engine-core-execute-dummy-batch",
        component="vllm",
        path=_ENGINE_CORE,
        locator="python",
        symbol="EngineCore.execute_dummy_batch",
        line=785,
        sha256="42b2ac6edbff6901c083aeab89a99072605609ce59340f7fc3ec3e69ae41c962",
        relied_on="EngineCore.execute_dummy_batch only forwards to the executor (verl's GLM-5.2 patch requires this "
        "exact source and skips the forward while the executor sleeps)",
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (patch_vllm_glm52_partial_wake_up)",
        expects=(
            Expect(
                "def execute_dummy_batch(self):\n        self.model_executor.execute_dummy_batch()",
                "the whole method",
                match="equals",
                ignore_whitespace=True,
            ),
        ),
    ),
    Contract(
        id="vllm-engine-core-execute-dummy-batch-defined-once",
        component="vllm",
        path=_ENGINE_CORE,
        locator="grep",
        symbol=r"^class |def execute_dummy_batch\(",
        line=0,
        sha256="8c88fa22ffd66d7c3311c446afabb87a160224b046eb9f1fe209af8f587c7962",
        relied_on="execute_dummy_batch is defined in EngineCore only: EngineCoreProc and DPEngineCoreProc inherit it, "
        "so DPEngineCoreProc.execute_dummy_batch (what verl's patch reads and replaces) is EngineCore's",
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (patch_vllm_glm52_partial_wake_up)",
        expects=(
            Expect(
                "core.py: class EngineCore:\nvllm/v1/engine/core.py: def execute_dummy_batch(self):\n"
                "vllm/v1/engine/core.py: class EngineShutdownState(IntEnum):",
                "defined in EngineCore, before the process classes",
            ),
            Expect("class DPEngineCoreProc(EngineCoreProc):", "DPEngineCoreProc derives from EngineCoreProc"),
        ),
    ),
    Contract(
        id="vllm-dp-engine-core-busy-loop-runs-dummy-batches",
        component="vllm",
        path=_ENGINE_CORE,
        locator="python",
        symbol="DPEngineCoreProc.run_busy_loop",
        line=1869,
        sha256="6ed9185e8c1d9eb974877fae9751874fda04ed8dcd7c7f855a3e4fdec656df52",
        relied_on="a data-parallel engine with no work runs a dummy batch (a forward) whatever the sleep state, which "
        "touches released memory during a partial wake-up; verl's GLM-5.2 patch checks this source",
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (patch_vllm_glm52_partial_wake_up)",
        expects=(
            Expect(
                "with self.log_iteration_details(None):\n                    self.execute_dummy_batch()",
                "an idle DP rank runs a dummy batch",
                ignore_whitespace=True,
            ),
            Expect(
                "elif not self.model_executor.is_sleeping:\n                with self.log_iteration_details(None):\n"
                "                    self.execute_dummy_batch()",
                "the fix (vLLM 11d60545e2) is not upstream at our pin: verl's patch applies it",
                present=False,
                ignore_whitespace=True,
            ),
        ),
    ),
    Contract(
        id="vllm-engine-core-process-entrypoint",
        component="vllm",
        path=_ENGINE_CORE,
        locator="python",
        symbol="EngineCoreProc.run_engine_core",
        line=1118,
        sha256="3a0febd6a8c8f1f9a64925a99a66d5ea96406e2c06e1f55350c1782ac5d96693",
        relied_on="EngineCoreProc.run_engine_core(*args, **kwargs) is the engine-core process's entry point; verl's "
        "GLM-5.2 patch replaces it with a module-level function that patches the spawned process, then calls it",
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (_glm52_run_engine_core)",
        expects=(
            Expect("def run_engine_core(*args, dp_rank: int = 0, local_dp_rank: int = 0, **kwargs):", "signature"),
        ),
    ),
    Contract(
        id="vllm-engine-core-process-launched-by-attribute",
        component="vllm",
        path="vllm/v1/engine/utils.py",
        locator="python",
        symbol="CoreEngineProcManager.__init__",
        line=127,
        sha256="9d0014d0572ecc2420da3bd15d41094ea2c546e1a9f953852156be7e02e2c79e",
        relied_on="engine-core processes are started with target=EngineCoreProc.run_engine_core read when they start "
        "(a function-level import), so verl's replacement is what the spawned process runs",
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (patch_vllm_glm52_partial_wake_up)",
        expects=(
            Expect("from vllm.v1.engine.core import EngineCoreProc", "looked up at launch time"),
            Expect("target=EngineCoreProc.run_engine_core,", "the attribute verl replaces"),
        ),
    ),
    Contract(
        id="vllm-routed-experts-capturer",
        component="vllm",
        path=_ROUTES_CAPTURER,
        locator="python",
        symbol="RoutedExpertsCapturer.capture",
        line=110,
        sha256="cffcbcfb0e697748d2c02ef18f6178c53339e57fe4399a5b4d599cd2d865c13b",
        relied_on="RoutedExpertsCapturer.capture(self, layer_id, topk_ids) exists: vllm-ascend's "
        "patch_routed_experts_capture (imported by verl's GLM-5.2 patch) replaces it",
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (apply_npu_vllm_patches)",
        expects=(Expect("def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:", "the method replaced"),),
    ),
    # --- the rollout as preflight models it (verl_npu/preflight/rollout.py, docs/preflight_rollout.md) ----------
    Contract(
        id="vllm-kv-cache-must-hold-one-request",
        component="vllm",
        path=_KV_CACHE_UTILS,
        locator="python",
        symbol="_check_enough_kv_cache_memory",
        line=713,
        sha256="67cc6e6e5eb18b1d315d15dde7ea0ab5a3772204a99fbac8183cd619eae2f3f7",
        relied_on="the engine does not start when no memory is left for the KV cache, or when one request of "
        "max_model_len needs more KV cache than is available; it then names the longest max_model_len that fits",
        used_by="verl_npu/preflight/rollout.py (kv_cache_checks)",
        expects=(
            Expect("if available_memory <= 0:\n        raise ValueError(", "no memory at all"),
            Expect("if needed_memory > available_memory:", "one request must fit"),
            Expect("the estimated maximum model length is {estimated_max_len}", "the length that fits, in words"),
        ),
    ),
    Contract(
        id="vllm-kv-cache-checked-per-worker",
        component="vllm",
        path=_KV_CACHE_UTILS,
        locator="python",
        symbol="get_kv_cache_configs",
        line=1956,
        sha256="9ca0189a286c01b813cd98bc39ddf1a2f7e96293d237c3f57001bfe279f4b9e7",
        relied_on="every worker's KV cache groups are checked against its own available memory",
        used_by="verl_npu/preflight/rollout.py (one rank's estimate)",
        expects=(
            Expect(
                "_check_enough_kv_cache_memory(\n            avail_mem,\n            "
                "partial(_max_memory_usage_bytes_from_groups, vllm_config, groups),",
                "needed memory from the worker's groups",
            ),
        ),
    ),
    Contract(
        id="vllm-kv-cache-layers-of-one-type-share-a-group",
        component="vllm",
        path=_KV_CACHE_UTILS,
        locator="python",
        symbol="get_kv_cache_groups",
        line=1629,
        sha256="83ff2e4abd4977412a6084c9b7c7ccb74f189fc2d1ffb73dd9121840e275df88",
        relied_on="layers of one KV cache type with different page sizes (GLM-5.2's full and shared DSA layers) go "
        "into one UniformTypeKVCacheSpecs group",
        used_by="verl_npu/preflight/rollout.py (RolloutEstimate.needed_kv_bytes)",
        expects=(Expect("elif uniform_spec := UniformTypeKVCacheSpecs.from_specs(kv_cache_spec):", "one group"),),
    ),
    Contract(
        id="vllm-kv-cache-one-group-sums-its-layers",
        component="vllm",
        path=_KV_CACHE_UTILS,
        locator="python",
        symbol="_max_memory_usage_bytes_from_groups",
        line=1752,
        sha256="f97a78e7edea52f731daabbfa2579511f20c24cf0b116bf0473ff0e3800f1659",
        relied_on="for one UniformTypeKVCacheSpecs group, one request needs the sum over its layers of each layer's "
        "max_memory_usage_bytes",
        used_by="verl_npu/preflight/rollout.py (RolloutEstimate.needed_kv_bytes)",
        expects=(
            Expect(
                "return sum(\n            spec.max_memory_usage_bytes(vllm_config)\n            for spec in "
                "per_layer_specs.values()\n        )",
                "a sum over layers",
            ),
        ),
    ),
    Contract(
        id="vllm-enforce-eager-captures-no-graphs",
        component="vllm",
        path="vllm/config/vllm.py",
        locator="grep",
        symbol=r"enforce_eager:$|cudagraph_mode = CUDAGraphMode\.NONE$",
        line=0,
        sha256="cf113ed160828df9ee518bdaff3aece3af421b52a302dce833a793b61247d62d",
        relied_on="enforce_eager sets cudagraph_mode to NONE whatever compilation_config asked for",
        used_by="verl_npu/preflight/values.py (RolloutValues.graphs), verl_npu/preflight/rollout.py",
        expects=(
            Expect(
                "if self.model_config is not None and self.model_config.enforce_eager:\nvllm/config/vllm.py: "
                "self.compilation_config.cudagraph_mode = CUDAGraphMode.NONE",
                "eager: no graphs",
            ),
        ),
    ),
    Contract(
        id="vllm-cudagraph-mode-names",
        component="vllm",
        path="vllm/config/compilation.py",
        locator="python",
        symbol="CompilationConfig.validate_cudagraph_mode_before",
        line=858,
        sha256="1df843843ab4261c2c3b9709c58b8f64ba9e994dadf8168427bf7396db47e9db",
        relied_on="cudagraph_mode given as text is the CUDAGraphMode member of that name, upper-cased",
        used_by="verl_npu/preflight/values.py (CUDAGRAPH_MODES)",
        expects=(Expect("return CUDAGraphMode[value.upper()]", "by name"),),
    ),
    Contract(
        id="vllm-cudagraph-modes",
        component="vllm",
        path="vllm/config/compilation.py",
        locator="python",
        symbol="CUDAGraphMode",
        line=53,
        sha256="17fab8993e61896d11db7a99f33398e301bc33b77c7a410c5fd2f9cedff8fed9",
        relied_on="the graph modes are NONE, PIECEWISE, FULL, FULL_DECODE_ONLY and FULL_AND_PIECEWISE",
        used_by="verl_npu/preflight/values.py (CUDAGRAPH_MODES)",
        expects=(
            Expect(
                "NONE = 0\n    PIECEWISE = 1\n    FULL = 2\n    FULL_DECODE_ONLY = (FULL, NONE)\n    "
                "FULL_AND_PIECEWISE = (FULL, PIECEWISE)",
                "the members",
            ),
        ),
    ),
    Contract(
        id="vllm-fused-moe-loads-experts-in-place",
        component="vllm",
        path="vllm/model_executor/layers/fused_moe/layer.py",
        locator="python",
        symbol="FusedMoE._load_w13",
        line=715,
        sha256="5c04a9bb650559eb580cd6e3299f1a5fcb4c7b5fd81eb7d17f6d6e5b58967c6a",
        relied_on="FusedMoE's loader copies a checkpoint expert into a narrowed view of the parameter, in place "
        "(the storage the rollout's graphs read stays the same)",
        used_by="verl_npu/preflight/rollout.py (graph_checks)",
        expects=(Expect("expert_data.copy_(loaded_weight)", "in place"),),
    ),
    # --- R3: the routes the rollout returns (verl_npu/preflight/router_replay.py, docs/preflight_rollout.md) ----
    Contract(
        id="vllm-routes-capturer-config-keys",
        component="vllm",
        path=_ROUTES_CAPTURER,
        locator="grep",
        symbol=r'getattr\(hf_config, "|for key in \(|raise ValueError\($',
        line=0,
        sha256="dfc5f58a013b8b4ee500afd2ce1eefbcb84a5d4c8aeb8c7cb47bcce7fa7e8503",
        relied_on="the route capturer reads top-k from num_experts_per_tok, else top_k_experts, and the expert count "
        "from num_experts, n_routed_experts or num_local_experts, and raises when the model's config has neither",
        used_by="verl_npu/preflight/router_replay.py (EXPERT_COUNT_KEYS, EXPERTS_PER_TOKEN_KEYS)",
        expects=(
            Expect('val = getattr(hf_config, "num_experts_per_tok", None)', "top-k, first name"),
            Expect('val = getattr(hf_config, "top_k_experts", None)', "top-k, second name"),
            Expect('for key in ("num_experts", "n_routed_experts", "num_local_experts"):', "the expert count's names"),
        ),
    ),
    Contract(
        id="vllm-routes-capturer-buffer",
        component="vllm",
        path=_ROUTES_CAPTURER,
        locator="python",
        symbol="RoutedExpertsCapturer.__init__",
        line=86,
        sha256="f631ebd7311ad061b0eedb5dda23d3eefcab59b14540009297bc6b8d1c728452",
        relied_on="a worker's capture buffer is [max_num_batched_tokens, num_hidden_layers, top-k] int32 of the "
        "language model's config: one column per decoder layer, MoE or not",
        used_by="verl_npu/preflight/router_replay.py, verl_npu/preflight/memory_plan.py (R3's routes per token), "
        "tests_npu/preflight/test_preflight_router_replay.py (executes it)",
        expects=(
            Expect("hf_config = vllm_config.model_config.hf_text_config", "the language model's config"),
            Expect(
                "self.device_buffer = torch.zeros( ( max_num_batched_tokens, hf_config.num_hidden_layers, "
                "num_experts_per_tok, ),",
                "tokens x every decoder layer x top-k",
                ignore_whitespace=True,
            ),
            Expect("dtype=torch.int32,", "int32"),
        ),
    ),
    Contract(
        id="vllm-routes-capture-by-absolute-layer",
        component="vllm",
        path=_ROUTES_CAPTURER,
        locator="python",
        symbol="RoutedExpertsCapturer.capture",
        line=110,
        sha256="cffcbcfb0e697748d2c02ef18f6178c53339e57fe4399a5b4d599cd2d865c13b",
        relied_on="vLLM's capture writes a layer's routes into its column (layer_id), rows of this DP rank's tokens; "
        "without DP metadata it keeps what the rank routed, under DP it accepts the whole step, this rank's tokens or "
        "an even sequence-parallel shard, and raises 'unexpected topk_ids batch dim' on any other slice (an uneven "
        "all-to-all one)",
        used_by="verl_npu/preflight/router_replay.py (R3 with rollout TP > 1, EP > 1 needs vllm-ascend's capture), "
        "tests_npu/preflight/test_preflight_router_replay.py (executes it)",
        expects=(
            Expect(
                "if ctx.dp_metadata is None:  # single dp\n            start_loc = 0\n            end_loc = "
                "topk_ids.shape[0]",
                "one DP rank: kept as routed",
            ),
            Expect(
                "and n == (token_num_per_dp + self.tp_size - 1) // self.tp_size",
                "only the ceil-div shard is gathered",
            ),
            Expect('"RoutedExpertsCapturer: unexpected topk_ids batch "', "any other slice raises"),
            Expect(
                "n == token_num_per_dp // self.tp_size",
                "the shorter all-to-all slice is not accepted at our pin (vllm-ascend's capture accepts it)",
                present=False,
            ),
            Expect(
                "self.device_buffer[:token_num_per_dp, layer_id, :] = topk_ids[",
                "written into the layer's own column",
            ),
        ),
    ),
    Contract(
        id="vllm-fused-moe-layer-id-is-its-decoder-layer",
        component="vllm",
        path="vllm/model_executor/layers/fused_moe/layer.py",
        locator="python",
        symbol="FusedMoE.layer_id",
        line=481,
        sha256="bfdad175459fe309b23a5c2e58d19fbe141c8f3a0002ad86e4c909ed3c75828e",
        relied_on="a FusedMoE layer's layer_id is the number in its module name (model.layers.5.mlp.experts -> 5), "
        "so the routes land in the decoder layer's column and dense layers' columns stay 0",
        used_by="verl_npu/preflight/router_replay.py, docs/preflight_rollout.md (routes indexed by absolute layer)",
        expects=(Expect("return extract_layer_index(self.layer_name)", "from the module's name"),),
    ),
    Contract(
        id="vllm-runner-binds-the-routes-capturer-it-makes",
        component="vllm",
        path="vllm/v1/worker/gpu_model_runner.py",
        locator="python",
        symbol="GPUModelRunner.init_routed_experts_capturer",
        line=7357,
        sha256="5f3cf2c53d91f669b20fe16885a6f08213179fbaa3a14f6c11808e25ea55a6e3",
        relied_on="the runner makes one capturer sized by the scheduler's max_num_batched_tokens and hands it to "
        "_bind_routed_experts_capturer, which vllm-ascend's NPU runner overrides",
        used_by="verl_npu/preflight/router_replay.py (the R3 rollout check's capture path)",
        expects=(
            Expect(
                "self.routed_experts_capturer = RoutedExpertsCapturer( "
                "max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,",
                "one capturer for the largest step",
                ignore_whitespace=True,
            ),
            Expect(
                "self._bind_routed_experts_capturer(self.routed_experts_capturer)", "bound by an overridable method"
            ),
        ),
    ),
    Contract(
        id="vllm-routes-per-request-prompt-then-forwarded-tokens",
        component="vllm",
        path="vllm/v1/core/sched/scheduler.py",
        locator="grep",
        symbol=r"routed_experts = |if num_output_tokens_before == 0:|^\s*request\.num_prompt_tokens,$",
        line=0,
        sha256="02bc23d5c95c8193af0407708537e894187be8b0e97bec04e6fadfb9b342cee2",
        relied_on="when a request's prefill completes the scheduler hands it the prompt's routes (one row per prompt "
        "token), after that the rows of the tokens forwarded in the step; the last sampled token is never forwarded, "
        "so a finished request has prompt + response - 1 rows",
        used_by="verl_npu/preflight/router_replay.py (the shape it reports), docs/preflight_rollout.md",
        expects=(
            Expect(
                "if num_output_tokens_before == 0:\nvllm/v1/core/sched/scheduler.py: routed_experts = "
                "self.routed_experts_mgr.get(\nvllm/v1/core/sched/scheduler.py: request.num_prompt_tokens,",
                "the prompt's routes when its prefill completes",
            ),
            Expect("routed_experts = routing_data[end - len(new_token_ids) : end]", "then the forwarded tokens' rows"),
        ),
    ),
    Contract(
        id="vllm-routes-joined-when-the-request-finishes",
        component="vllm",
        path="vllm/v1/engine/output_processor.py",
        locator="grep",
        symbol=r"routed_experts_chunks",
        line=0,
        sha256="e6c7b7c6a33127ecdfc9098225a2aeb1b22c8583a038996c544e622b4d21c44c",
        relied_on="the output processor keeps each step's routes of a request and returns them joined along the "
        "tokens only when it finishes (CompletionOutput.routed_experts, [tokens, layers, top-k])",
        used_by="verl_npu/preflight/router_replay.py (the shape it reports)",
        expects=(
            Expect("req_state.routed_experts_chunks.append(", "each step's rows kept"),
            Expect(
                "if finished and self.routed_experts_chunks:\nvllm/v1/engine/output_processor.py: routed_experts = "
                "np.concatenate(self.routed_experts_chunks, axis=0)",
                "joined along the tokens at the end",
            ),
        ),
    ),
    Contract(
        id="vllm-routes-refused-with-pipeline-parallelism-or-a-kv-connector",
        component="vllm",
        path="vllm/config/vllm.py",
        locator="grep",
        symbol=r"\.enable_return_routed_experts$|enable-return-routed-experts is incompatible|"
        r'"pipeline parallelism \(PP > 1\)\."|"connectors \(PD disaggregation',
        line=0,
        sha256="6bffa5b4a48298dfb0fcaa571a60c70a5ab9ef631c8c6b58db6f0429853f0f41",
        relied_on="vLLM refuses enable_return_routed_experts at engine start with pipeline parallelism and with any "
        "KV connector (prefill/decode disaggregation, KV offload)",
        used_by="verl_npu/preflight/router_replay.py (R3 with rollout disaggregation is a FAIL)",
        expects=(
            Expect('"pipeline parallelism (PP > 1)."', "refused with PP > 1"),
            Expect('"connectors (PD disaggregation, KV cache offload)."', "refused with a KV connector"),
        ),
    ),
    Contract(
        id="vllm-dp-metadata-only-with-data-parallelism",
        component="vllm",
        path="vllm/forward_context.py",
        locator="python",
        symbol="set_forward_context",
        line=250,
        sha256="fada46e79a6c37546977c5559ba8e0ed65fe2bad24c89df8fad307c55f71c574",
        relied_on="a forward gets DP metadata (tokens per DP rank) only when data_parallel_size > 1: with DP 1 the "
        "route capturers take the single-rank branch and gather nothing",
        used_by="verl_npu/preflight/router_replay.py (R3 with rollout DP 1, TP > 1, EP > 1 is a FAIL)",
        expects=(
            Expect(
                "dp_metadata: DPMetadata | None = None if ( vllm_config.parallel_config.data_parallel_size > 1",
                "DP metadata only with DP > 1",
                ignore_whitespace=True,
            ),
            Expect("dp_metadata = DPMetadata.make(", "made there"),
        ),
    ),
)

# verl 0.9.1's GLM-5.2 patch: each vLLM object it reads or replaces (as verl names it) -> the contracts on it.
VERL_GLM52_PATCH_TARGETS = {
    "vllm.v1.engine.core.EngineCore.wake_up": (
        "vllm-engine-core-wake-up-resumes-scheduling",
        "vllm-executor-partial-wake-up-keeps-sleeping",
    ),
    "vllm.v1.engine.core.DPEngineCoreProc.run_busy_loop": ("vllm-dp-engine-core-busy-loop-runs-dummy-batches",),
    "vllm.v1.engine.core.DPEngineCoreProc.execute_dummy_batch": (
        "vllm-engine-core-execute-dummy-batch",
        "vllm-engine-core-execute-dummy-batch-defined-once",
    ),
    "vllm.v1.engine.core.EngineCoreProc.run_engine_core": (
        "vllm-engine-core-process-entrypoint",
        "vllm-engine-core-process-launched-by-attribute",
    ),
}
