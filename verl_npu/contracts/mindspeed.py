"""What verl-npu relies on in MindSpeed core_r0.18.0 (commit pinned in verl_npu/stack/stack.toml).

The constants are the facts our code reads (the engine's build plan, the GLM-5 bridge); the
contracts tie each one to the MindSpeed source that makes it true.
"""

from __future__ import annotations

from verl_npu.contracts.spec import Contract, Expect

_DSA_FEATURE = "mindspeed/features_manager/transformer/experimental_attention_variant/dsa.py"
_DSA_FUSED = "mindspeed/core/transformer/experimental_attention_variant/dsa_npu_fused.py"
_DSA_ABSORB = "mindspeed/core/transformer/experimental_attention_variant/dsa_matrix_absorption.py"
_DSA_CP = "mindspeed/core/transformer/experimental_attention_variant/dsa_kvallgather_context_parallel.py"

# MindSpeed's DSA switches: its docs and validate_args say they go on or off together (the fused
# operators take absorbed MLA only, and the indexer operator has no autograd of its own).
DSA_ABSORB = "use_dsa_absorb"
DSA_FUSED_OPERATORS = (
    "use_fused_lightning_indexer",
    "use_fused_sparse_flash_attention",
    "use_fused_lightning_indexer_kl_loss",
)
DSA_SWITCHES = (DSA_ABSORB, *DSA_FUSED_OPERATORS)
# The KL-loss operator receives the attention heads all-gathered over TP as its Q_N.
FUSED_KL_ATTENTION_HEADS = (32, 64, 128)
DSA_CP_ALGORITHM = "kvallgather_cp_algo"
# MindSpeed's DSA feature class, and the attribute its kv-allgather CP wrapper and the always-on NpuEnhancement
# feature both patch (MindSpeedPatchesManager names a target by its dotted path).
DSA_FEATURE_CLASS = "DeepSeekSparseAttention"
POST_INIT_TARGET = "megatron.core.transformer.transformer_config.TransformerConfig.__post_init__"
# Read from MindSpeed's args without a default on the fused path: repatch must always set them.
ARGS_READ_WITHOUT_DEFAULT = ("context_parallel_size", "context_parallel_algo")
# MLASelfAttentionAbsorb's parameters (the GLM-5 bridge maps each one); linear_proj and
# core_attention come from megatron's MultiLatentAttention.
ABSORBED_ATTENTION_PARAMETERS = (
    "linear_q_down_proj.weight",
    "linear_q_up_proj.weight",
    "q_layernorm.weight",
    "linear_kv_down_proj.weight",
    "kv_layernorm.weight",
    "linear_k_up_proj.weight",
    "linear_v_up_proj.weight",
    "linear_proj.weight",
)

CONTRACTS = (
    Contract(
        id="mindspeed-repatch-sets-every-key",
        component="mindspeed",
        path="mindspeed/megatron_adaptor.py",
        locator="python",
        symbol="repatch",
        line=54,
        sha256="987b857efb819b304d7ba2de93f53a2a095121bff2e48031652eba4eb576ecdc",
        relied_on="repatch(args) removes MindSpeed's patches, sets every key of args on the full args and re-applies "
        "every feature that wants to apply with them",
        used_by="verl_npu/engine/verl_engine.py (the engine calls repatch with the build plan's mindspeed_repatch)",
        expects=(
            Expect("MindSpeedFeaturesManager.remove_patches()", "patches are removed first"),
            Expect("setattr(full_args, k, v)", "every key we pass lands on the args features read"),
            Expect("MindSpeedFeaturesManager.apply_features_patches(full_args)", "features re-apply with our keys"),
        ),
    ),
    Contract(
        id="mindspeed-args-without-megatron-training",
        component="mindspeed",
        path="mindspeed/args_utils.py",
        locator="python",
        symbol="get_full_args",
        line=55,
        sha256="517fa4f93c9f4618f5a1e6b45be883f726a06c5c06ddd5906d9e816129f51297",
        relied_on="when megatron.training's global args are not initialised (verl builds models without them), "
        "MindSpeed's features read its own parser's args: a key it registers no option for exists only if repatch "
        "sets it",
        used_by="verl_npu/engine/build_plan.py (mindspeed_repatch carries experimental_attention_variant and "
        "context_parallel_size)",
        expects=(
            Expect("get_mindspeed_args()", "MindSpeed's own args stand in for megatron's"),
            Expect("'args is not initialized.'", "verl's case: megatron.training args never initialised"),
        ),
    ),
    Contract(
        id="mindspeed-dsa-applies-only-for-variant-dsa",
        component="mindspeed",
        path=_DSA_FEATURE,
        locator="python",
        symbol="DeepSeekSparseAttention.is_need_apply",
        line=15,
        sha256="7bedc0dc534e33964fdbb7d27a31accedf619841632eb5e961fe7dcbf6810d3a",
        relied_on="MindSpeed's DSA feature (fused operators, absorption, kv-allgather CP) applies only when "
        "args.experimental_attention_variant == 'dsa'",
        used_by="verl_npu/engine/build_plan.py (the whole override_transformer_config reaches repatch)",
        expects=(Expect("getattr(args, 'experimental_attention_variant', None) == 'dsa'", "the variant key gates it"),),
    ),
    Contract(
        id="mindspeed-dsa-options",
        component="mindspeed",
        path=_DSA_FEATURE,
        locator="python",
        symbol="DeepSeekSparseAttention.register_args",
        line=19,
        sha256="3fb595343f6fcc564dad12cd098f26294b0e97e8619d3da065791b0cf388ba01",
        relied_on="MindSpeed registers options for the four DSA switches and none for experimental_attention_variant",
        used_by="verl_npu/engine/build_plan.py (MINDSPEED_ONLY_KEYS, mindspeed_repatch)",
        expects=(
            *(Expect(f'"--{flag.replace("_", "-")}"', f"--{flag} is a MindSpeed option") for flag in DSA_SWITCHES),
            Expect("--experimental-attention-variant", "no option: only repatch can set the variant", present=False),
        ),
    ),
    Contract(
        id="mindspeed-dsa-rules",
        component="mindspeed",
        path=_DSA_FEATURE,
        locator="python",
        symbol="DeepSeekSparseAttention.validate_args",
        line=37,
        sha256="f4eed92668d0ba4d8a7b9cd64aa21083fc4784ea8cc76177be44ca982b77c2fa",
        relied_on="the three fused operators go together; the fused KL loss needs num_attention_heads in "
        f"{FUSED_KL_ATTENTION_HEADS}; CP > 1 needs {DSA_CP_ALGORITHM}; DSA needs qk_layernorm and no eod_mask_loss "
        "(checked when TransformerConfig is built, see mindspeed-config-validates-features)",
        used_by="verl_npu/engine/build_plan.py (the same rules, reported before the job queues)",
        expects=(
            Expect("not (use_p1 and use_p2 and use_p3)", "the three fused operators only together"),
            Expect(f"not in {FUSED_KL_ATTENTION_HEADS}", "fused KL loss attention heads"),
            Expect(f"!= '{DSA_CP_ALGORITHM}'", "CP > 1 needs the kv-allgather algorithm"),
            Expect("'qk_layernorm'", "DSA needs qk_layernorm"),
            Expect("'eod_mask_loss'", "DSA refuses eod_mask_loss"),
        ),
    ),
    Contract(
        id="mindspeed-dsa-patches",
        component="mindspeed",
        path=_DSA_FEATURE,
        locator="python",
        symbol="DeepSeekSparseAttention.register_patches",
        line=86,
        sha256="64a113e7c50d045baebbd8daab26657ba21fe97491f1122b4d2718eb58a738d6",
        relied_on="with the three fused switches MindSpeed assigns DSAttention.forward and "
        "DSAIndexer.forward_with_scores directly (repatch cannot undo it; verl-npu's dsa-* patches are not in effect "
        "on that path); use_dsa_absorb swaps MLASelfAttention for MLASelfAttentionAbsorb; with CP > 1 and "
        f"{DSA_CP_ALGORITHM} it wraps TransformerConfig.__post_init__ to let DSA build with CP (by assignment, which "
        "its own patch manager then undoes: see mindspeed-dsa-cp-wrapper-by-assignment)",
        used_by="verl_npu/engine/build_plan.py (features and notes the plan reports)",
        expects=(
            Expect("DSAttention.forward = dsa_npu_fused.fused_dsa_attn_forward", "fused attention replaces forward"),
            Expect(
                "DSAIndexer.forward_with_scores = dsa_npu_fused.forward_with_scores", "fused indexer replaces scores"
            ),
            Expect("MLASelfAttentionAbsorb,", "use_dsa_absorb builds the absorbed attention"),
            Expect(f"== '{DSA_CP_ALGORITHM}'", "the CP bypass needs the kv-allgather algorithm"),
            Expect("TransformerConfig.__post_init__ = transformer_config_post_init_wrapper(", "the CP bypass"),
        ),
    ),
    Contract(
        id="mindspeed-dsa-cp-wrapper-by-assignment",
        component="mindspeed",
        path=_DSA_FEATURE,
        locator="python",
        symbol="DeepSeekSparseAttention.register_patches",
        line=86,
        sha256="64a113e7c50d045baebbd8daab26657ba21fe97491f1122b4d2718eb58a738d6",
        relied_on="the kv-allgather CP wrapper is assigned to TransformerConfig.__post_init__ directly, not registered "
        "with MindSpeedPatchesManager, so the manager's later apply_patches in the same repatch replaces it with the "
        "managed NpuEnhancement patch of that attribute (the wrapper is lost; a DSA config at CP > 1 asserts)",
        used_by="verl_npu/runtime_patches/mindspeed_dsa_cp_config.py (registers the wrapper with the manager after "
        "repatch; remove it when this contract fails because MindSpeed registers it itself)",
        expects=(
            Expect(
                "TransformerConfig.__post_init__=transformer_config_post_init_wrapper(TransformerConfig.__post_init__)",
                "the wrapper is installed by plain assignment",
                ignore_whitespace=True,
            ),
            Expect(f"'{POST_INIT_TARGET}'", "the wrapper is not registered with the patch manager", present=False),
            Expect("self._get_context_parallel_size(args) > 1", "CP size read through the feature's helper"),
            Expect(
                f"getattr(args, 'context_parallel_algo', None) == '{DSA_CP_ALGORITHM}'",
                "the algorithm verl-npu's patch compares with",
            ),
        ),
    ),
    Contract(
        id="mindspeed-npu-enhancement-manages-post-init",
        component="mindspeed",
        path="mindspeed/features_manager/npu_enhancement/npu_enhancement.py",
        locator="python",
        symbol="NpuEnhancementFeature._register_config_patches",
        line=166,
        sha256="5b7210b8ed94f2052b9634b09f37389d332fab23b4c0089abe83880a864d911d",
        relied_on="the always-on NpuEnhancement feature registers a managed patch of TransformerConfig.__post_init__ "
        "(its argument wrapper): every apply_patches re-applies that attribute from the manager's original",
        used_by="verl_npu/runtime_patches/mindspeed_dsa_cp_config.py (why the DSA CP wrapper is lost)",
        expects=(Expect(f"'{POST_INIT_TARGET}',", "a managed patch of the same attribute"),),
    ),
    Contract(
        id="mindspeed-patch-manager-reapplies-from-original",
        component="mindspeed",
        path="mindspeed/patch_utils.py",
        locator="python",
        symbol="Patch.apply_patch",
        line=110,
        sha256="b869a456dd18ac216489857d34de6d43e55a6b711114b76e2c156ad5a4c7335c",
        relied_on="a managed patch is rebuilt from the original function kept at its first application (wrappers "
        "applied over it in order), whatever the attribute holds now",
        used_by="verl_npu/runtime_patches/mindspeed_dsa_cp_config.py (a wrapper must be registered to survive)",
        expects=(
            Expect("if self.orig_module is None:", "the original is captured once"),
            Expect("final_patch_func = self.orig_func", "rebuilt from that original"),
            Expect("for wrapper in self.wrappers:", "registered wrappers are applied over it"),
        ),
    ),
    Contract(
        id="mindspeed-patch-manager-keeps-one-copy-of-a-wrapper",
        component="mindspeed",
        path="mindspeed/patch_utils.py",
        locator="python",
        symbol="Patch.set_patch_func",
        line=70,
        sha256="70d0e5bce2f410f8c4219904768d21dd46d931179881312208cabce938c99d50",
        relied_on="a function whose name ends with 'wrapper' is registered as a wrapper, once however often it is "
        "registered, and re-registering marks the patch for re-application",
        used_by="verl_npu/runtime_patches/mindspeed_dsa_cp_config.py (registering after every repatch is idempotent)",
        expects=(
            Expect("new_func.__name__.endswith(('wrapper', 'decorator'))", "wrappers are recognised by name"),
            Expect("if new_func not in self.wrappers:", "one copy of each wrapper"),
            Expect("self.is_applied = False", "re-applied on the next apply_patches"),
        ),
    ),
    Contract(
        id="mindspeed-default-features-list",
        component="mindspeed",
        path="mindspeed/features_manager/__init__.py",
        locator="python",
        symbol="create_features_list",
        line=358,
        sha256="55236577d3e4d8977ee24a5c4df23478b816fe04b1006bf591ae613afd084ea5",
        relied_on="MindSpeed's default features list holds the NpuEnhancement feature (basic features, first) and "
        "the DSA feature (transformer features, later): both run in every repatch",
        used_by="verl_npu/runtime_patches/mindspeed_dsa_cp_config.py; "
        "tests_npu/patching/test_ascend_sim_mindspeed.py runs this list",
        expects=(
            Expect("add_basic_optimizer_features(features_list)", "NpuEnhancement is in the list"),
            Expect("add_transformer_features(features_list)", "DSA is in the list"),
        ),
    ),
    Contract(
        id="mindspeed-refuses-moe-grouped-gemm",
        component="mindspeed",
        path="mindspeed/features_manager/moe/gmm.py",
        locator="python",
        symbol="MoEGmmFeature.validate_args",
        line=16,
        sha256="29902605e846ee62af4b4937fe64757f1d5ddcd825c62299cd2d609450a72345",
        relied_on="MindSpeed core_r0.18.0 raises NotImplementedError for moe_grouped_gemm; building a "
        "TransformerConfig runs every feature's validate_args (mindspeed-config-validates-features), so a config "
        "with grouped experts does not build on Ascend",
        used_by="verl_npu/models/glm5/config.py (grouped GEMM off on Ascend); verl_npu/engine/build_plan.py (an "
        "override turning it on is refused before the job queues)",
        expects=(
            Expect("if getattr(args, 'moe_grouped_gemm', False):", "the switch is read from the config"),
            Expect("raise NotImplementedError(", "and refused"),
        ),
    ),
    Contract(
        id="mindspeed-dsa-cp-bypass",
        component="mindspeed",
        path=_DSA_CP,
        locator="python",
        symbol="transformer_config_post_init_wrapper",
        line=481,
        sha256="3a72f4d1c3ff702bb99f4c61561cbb7e42507deedc9cb05b1d504a94153055b2",
        relied_on="the kv-allgather CP wrapper runs megatron's TransformerConfig.__post_init__ with "
        "context_parallel_size 1, so megatron-core 0.18's DSA assertion (CP == 1) passes with CP > 1",
        used_by="verl_npu/engine/build_plan.py (CP > 1 with DSA only on Ascend, with kvallgather_cp_algo)",
        expects=(Expect("self.context_parallel_size = 1", "megatron sees CP 1 while it validates"),),
    ),
    Contract(
        id="mindspeed-config-validates-features",
        component="mindspeed",
        path="mindspeed/core/megatron_basic/arguments_basic.py",
        locator="python",
        symbol="transformer_config_post_init_wrapper",
        line=74,
        sha256="a932c3d076c5cf2e3f648102f2328dc4cf258782802d6ff7ee0af28121ac5da6",
        relied_on="building a TransformerConfig runs every MindSpeed feature's validate_args on the config (DSA's "
        "rules included), and the config carries every MindSpeed arg it lacks (e.g. use_fused_lightning_indexer)",
        used_by="verl_npu/engine/build_plan.py (a launch that breaks a DSA rule fails at model build on a node)",
        expects=(Expect("MindSpeedFeaturesManager.validate_features_args(args=self)", "features validate the config"),),
    ),
    Contract(
        id="mindspeed-fused-dsa-forward",
        component="mindspeed",
        path=_DSA_FUSED,
        locator="python",
        symbol="fused_dsa_attn_forward",
        line=550,
        sha256="a83e6e614787c149580ffb790e64005f680d1252d49317b1272e1d210e73e120",
        relied_on="the fused DSA forward reads args.context_parallel_size and args.context_parallel_algo without a "
        "default, and runs the KL-loss operator on every training forward whatever dsa_indexer_loss_coeff is (the "
        "loss is multiplied by the coefficient afterwards)",
        used_by="verl_npu/engine/build_plan.py (repatch always sets both args; the plan's notes say the KL operator "
        "runs at coefficient 0)",
        expects=(
            Expect("args.context_parallel_size > 1", "read without getattr"),
            Expect("args.context_parallel_algo", "read without getattr"),
            Expect("if self.training and torch.is_grad_enabled():", "the KL operator runs whenever training"),
            Expect("if self.config.use_fused_lightning_indexer_kl_loss:", "chosen by the switch, not the coefficient"),
        ),
    ),
    Contract(
        id="mindspeed-fused-indexer-topk",
        component="mindspeed",
        path=_DSA_FUSED,
        locator="python",
        symbol="fused_lightning_indexer",
        line=35,
        sha256="3dd45a5146e084ca15b4735bd27e8a1a00ab3789b6e91157c11a209daa965dd0",
        relied_on="the fused indexer asks npu_lightning_indexer for index_topk keys whatever the sequence length "
        "(the operator pads missing keys with -1), in bfloat16",
        used_by="verl_npu/engine/build_plan.py (index_topk must be a sparse_count the operator takes)",
        expects=(
            Expect("sparse_count=index_topk", "top-k is the configured index_topk"),
            Expect(".to(torch.bfloat16)", "the operator runs in bfloat16"),
        ),
    ),
    Contract(
        id="mindspeed-absorbed-attention-parameters",
        component="mindspeed",
        path=_DSA_ABSORB,
        locator="python",
        symbol="MLASelfAttentionAbsorb.__init__",
        line=270,
        sha256="9c10c9c5d9726ab0f209913dc037d215c436ded40cb407211a5eb9a5a414a266",
        relied_on="use_dsa_absorb builds linear_k_up_proj [kv_lora_rank -> heads * qk_head_dim] and "
        "linear_v_up_proj [kv_lora_rank -> heads * v_head_dim] instead of linear_kv_up_proj, and standalone "
        "q_layernorm / kv_layernorm modules",
        used_by="verl_npu/engine/bridges/glm5.py (loads and exports them as HF kv_b_proj)",
        expects=(
            Expect("self.linear_k_up_proj = build_module(", "a K up projection of its own"),
            Expect("self.linear_v_up_proj = build_module(", "a V up projection of its own"),
            Expect("self.config.num_attention_heads * self.config.qk_head_dim", "K rows: heads x qk_head_dim"),
            Expect("self.config.num_attention_heads * self.config.v_head_dim", "V rows: heads x v_head_dim"),
            Expect("self.q_layernorm = build_module(", "standalone q norm"),
            Expect("self.kv_layernorm = build_module(", "standalone kv norm"),
            Expect("linear_kv_up_proj", "no fused KV up projection", present=False),
        ),
    ),
    Contract(
        id="mindspeed-absorbed-k-rows-per-head",
        component="mindspeed",
        path=_DSA_ABSORB,
        locator="python",
        symbol="MLASelfAttentionAbsorb.get_query_key_value_tensors",
        line=601,
        sha256="5d06450f22d641be98ae2c7b46d7ac8f8db44ff582bdd6bbc564f8432d6d168a",
        relied_on="linear_k_up_proj's rows are head-major: weight.view(heads, qk_head_dim, kv_lora_rank)",
        used_by="verl_npu/engine/bridges/glm5.py (kv_b_proj = per head: 192 K rows, then 256 V rows)",
        expects=(
            Expect(
                "kv_nope_weight.view(self.num_attention_heads_per_partition, self.config.qk_head_dim, -1)",
                "K rows grouped per head",
            ),
        ),
    ),
    Contract(
        id="mindspeed-absorbed-v-rows-per-head",
        component="mindspeed",
        path=_DSA_ABSORB,
        locator="python",
        symbol="MLASelfAttentionAbsorb.forward",
        line=430,
        sha256="3b5fbae1d91bbcd0a29a9725e50c1066c1082e2764c969e18bb7dda9ea3c619d",
        relied_on="linear_v_up_proj's rows are head-major: weight.view(heads, v_head_dim, kv_lora_rank)",
        used_by="verl_npu/engine/bridges/glm5.py (kv_b_proj = per head: 192 K rows, then 256 V rows)",
        expects=(
            Expect(
                "v_weight.view(self.num_attention_heads_per_partition, self.config.v_head_dim, -1)",
                "V rows grouped per head",
            ),
        ),
    ),
    Contract(
        id="mindspeed-norm-ignores-use-fused-rmsnorm",
        component="mindspeed",
        path="mindspeed/core/megatron_basic/megatron_basic.py",
        locator="python",
        symbol="PTNorm.__new__",
        line=76,
        sha256="f1b232e6ab1cf94a9d905cd1157961c7f9dc56ca10056f2b90c009ed27a6fc0c",
        relied_on="every RMSNorm MindSpeed builds (PTNorm replaces megatron's norm classes at optimisation level 0) "
        "is TransformerEngine(-NPU)'s RMSNorm, whatever use_fused_rmsnorm says",
        used_by="verl_npu/engine/build_plan.py (the plan reports the Ascend norm as TE-NPU's)",
        expects=(
            Expect("from transformer_engine.pytorch import RMSNorm", "TE's RMSNorm"),
            Expect("args.use_fused_rmsnorm", "the switch is not read", present=False),
        ),
    ),
    Contract(
        id="mindspeed-norm-replaced-everywhere",
        component="mindspeed",
        path="mindspeed/features_manager/npu_enhancement/npu_enhancement.py",
        locator="python",
        symbol="NpuEnhancementFeature._register_norm_patches",
        line=213,
        sha256="ebae41d8a493523233a1ae55f45fa7888b6d0c43373633bc1de05e2c165281e6",
        relied_on="PTNorm replaces megatron's local, TE and block-level norm classes",
        used_by="verl_npu/engine/build_plan.py (the plan reports the Ascend norm as TE-NPU's)",
        expects=(
            Expect("'megatron.core.transformer.torch_norm.WrappedTorchNorm'", "local norm replaced"),
            Expect("'megatron.core.extensions.transformer_engine.TENorm'", "TE norm replaced"),
        ),
    ),
    Contract(
        id="mindspeed-fused-swiglu-unused",
        component="mindspeed",
        path="mindspeed",
        locator="grep",
        symbol=r"use_fused_swiglu|use-fused-swiglu",
        line=0,
        sha256="2cd2b3ac234025064c69e459c5f214f6de7df549c301a3de8803306a0e07d2c9",
        relied_on="no MindSpeed module reads use_fused_swiglu beyond registering and validating the option: "
        "it changes nothing in core_r0.18.0",
        used_by="verl_npu/engine/build_plan.py (the plan says use_fused_swiglu has no effect)",
        expects=(
            Expect('add_argument("--use-fused-swiglu"', "only registered"),
            Expect("config.use_fused_swiglu", "no reader on the config", present=False),
        ),
    ),
    Contract(
        id="mindspeed-patch-manager-overwrites-foreign-patches",
        component="mindspeed",
        path="mindspeed/patch_utils.py",
        locator="python",
        symbol="Patch.apply_patch",
        line=110,
        sha256="b869a456dd18ac216489857d34de6d43e55a6b711114b76e2c156ad5a4c7335c",
        relied_on="applying a managed patch assigns its function to the attribute whatever the attribute holds: a "
        "wrapper someone else installed over MindSpeed's function since (verl's router replay patches) is dropped "
        "by the next repatch",
        used_by="verl_npu/runtime_patches/mindspeed_router_replay.py (puts verl's replay patches back after each "
        "repatch)",
        expects=(
            Expect(
                "if self.orig_func_name is not None: setattr(self.orig_module, self.orig_func_name, final_patch_func)",
                "the assignment is guarded by nothing but the attribute's name",
                ignore_whitespace=True,
            ),
        ),
    ),
    Contract(
        id="mindspeed-patch-manager-removes-only-its-own",
        component="mindspeed",
        path="mindspeed/patch_utils.py",
        locator="python",
        symbol="Patch.remove_patch",
        line=95,
        sha256="e4df0acf1052a818c8956960a3d14bace6560d4c56dc9e7c5dc336b5b6a7adf6",
        relied_on="removing a managed patch restores the original only where the attribute still holds MindSpeed's "
        "function; a wrapper installed over it stays until the next application assigns over it",
        used_by="verl_npu/runtime_patches/mindspeed_router_replay.py (why verl's wrappers are lost only once "
        "MindSpeed applies again, the end of repatch)",
        expects=(
            Expect("id(getattr(value, self.orig_func_name)) == id(self.final_patch_func)", "only its own function"),
        ),
    ),
    Contract(
        id="mindspeed-fused-permute-manages-alltoall-preprocess",
        component="mindspeed",
        path="mindspeed/features_manager/fusions/fused_moe_permute.py",
        locator="python",
        symbol="FusedMoEPermuteFeature.register_patches",
        line=68,
        sha256="1da1f9b1ebea3c96af8296e6b0f47061cc95edfd9d2cde212630aea05f9f1636",
        relied_on="with moe_permute_fusion (or its alias use_fused_moe_token_permute_and_unpermute) and the alltoall "
        "dispatcher MindSpeed manages MoEAlltoAllTokenDispatcher.preprocess (a sync wrapper), where verl's router "
        "replay wraps it; without mindspeed.lite's triton sort (absent at this commit) it also manages the "
        "dispatcher's __init__ (see mindspeed-fused-permute-dispatcher-init-without-process-groups)",
        used_by="verl_npu/runtime_patches/mindspeed_router_replay.py; "
        "tests_npu/patching/test_ascend_sim_router_replay.py runs it",
        expects=(
            Expect(
                'getattr(args, self.feature_name, None) or getattr(args, "use_fused_moe_token_permute_and_unpermute"',
                "either switch turns the fused permutation on",
            ),
            Expect('if getattr(args, "moe_token_dispatcher_type", None) == "alltoall":', "for the alltoall dispatcher"),
            Expect(
                "'megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher.preprocess',",
                "the dispatcher's preprocess is managed",
            ),
            Expect("except ImportError", "the __init__ wrapper is registered where the triton sort cannot import"),
        ),
    ),
    Contract(
        id="mindspeed-fused-permute-dispatcher-init-without-process-groups",
        component="mindspeed",
        path="mindspeed/core/fusions/fused_moe_permute.py",
        locator="python",
        symbol="moe_alltoall_token_dispatcher_init_wrapper",
        line=109,
        sha256="a976a05bdf84b6dbf1133d191b9922c44c357afa145387090a870fc4ed62cc55",
        relied_on="MindSpeed's wrapper of the alltoall dispatcher's __init__ takes (num_local_experts, "
        "local_expert_indices, config) only; megatron-core 0.18's MoELayer passes pg_collection, so with the fused "
        "permutation on the alltoall dispatcher no MoE layer builds (TypeError)",
        used_by="tests_npu/patching/test_ascend_sim_router_replay.py (executes it; the build plan is to refuse the "
        "fused permutation with the alltoall dispatcher on Ascend)",
        expects=(
            Expect("def wrapper(self, num_local_experts, local_expert_indices, config) -> None:", "no pg_collection"),
            Expect("pg_collection", "nothing passes process groups on", present=False),
        ),
    ),
    Contract(
        id="mindspeed-tp-extend-ep-manages-routing",
        component="mindspeed",
        path="mindspeed/features_manager/moe/tp_extend_ep.py",
        locator="python",
        symbol="MoETpExtendEpFeature.register_patches",
        line=30,
        sha256="d369e07b420a1be268884ba22969965baf6da8e161ebfb9ce8bc952cd79db9b8",
        relied_on="moe_tp_extend_ep with the alltoall_seq dispatcher replaces TopKRouter.routing (where verl's replay "
        "routing sits); the feature first imports MindSpeed's moe_feature package, which imports megatron's legacy "
        "alltoall_seq dispatcher that megatron-core 0.18 no longer has, so any repatch with moe_tp_extend_ep raises",
        used_by="verl_npu/runtime_patches/mindspeed_router_replay.py (puts verl's routing back where MindSpeed "
        "manages it); tests_npu/patching/test_ascend_sim_router_replay.py (executes the import failure)",
        expects=(
            Expect("'megatron.core.transformer.moe.router.TopKRouter.routing',", "routing is managed"),
            Expect(
                "from mindspeed.core.transformer.moe.moe_feature.adaptor import MindSpeedAlltoAllSEQTptoEpMoELayer",
                "imported before any argument is read",
            ),
        ),
    ),
)
