"""What verl-npu relies on in vllm-ascend at the commit pinned in verl_npu/stack/stack.toml.

Besides the allocator and requirements facts: GLM-5.2's rollout. vllm-ascend builds no DSA indexer on
GLM-5.2's shared layers (so the GLM-5 bridge must send none, see :func:`layers_without_indexer`), and
verl 0.9.1 ships an opt-in patch of vllm-ascend 0.23 for GLM-5.2 RL weight updates
(``VERL_VLLM_ASCEND_GLM52_PATCH``, verl/utils/vllm/npu_vllm_patch.py) that checks the sources it
patches only when the rollout starts; the targets it checks are recorded here with its checks
(whitespace ignored, as verl compares them).
"""

from __future__ import annotations

from typing import Any

from verl_npu.contracts.spec import Contract, Expect

ALLOC_CONF_VARIABLE = "PYTORCH_NPU_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"

# verl 0.9.1's switch for its vllm-ascend 0.23 GLM-5.2 fixes and the values it accepts (lowercased, stripped);
# tests_npu/contracts/test_contracts.py reads both from verl's source.
GLM52_PATCH_VARIABLE = "VERL_VLLM_ASCEND_GLM52_PATCH"
GLM52_PATCH_ON_VALUES = ("1", "true", "yes")

_SFA = "vllm_ascend/attention/sfa_v1.py"
_DEVICE_OP = "vllm_ascend/device/device_op.py"
_GLM5_LAYERS_PATCH = "vllm_ascend/patch/worker/patch_deepseek_v2.py"
_MODEL_RUNNER = "vllm_ascend/worker/model_runner_v1.py"
_KV_SPEC = "vllm_ascend/core/kv_cache_interface.py"

# The MLA parameters vllm-ascend's DeepseekV2MLAAttention.__init__ builds when q_lora_rank is set (GLM-5).
MLA_PARAMETERS = (
    "fused_qkv_a_proj.weight",
    "q_a_layernorm.weight",
    "q_b_proj.weight",
    "kv_a_layernorm.weight",
    "kv_b_proj.weight",
    "o_proj.weight",
)
# IndexCache defaults vllm-ascend (and vLLM) read with getattr when the HF config lacks them.
INDEX_TOPK_FREQ_DEFAULT = 1
INDEX_SKIP_TOPK_OFFSET_DEFAULT = 2


def reuses_topk(hf_config: Any, layer: int) -> bool:
    """vllm-ascend's ``_skip_topk`` for a decoder layer: whether it reuses an earlier layer's top-k (from
    ``index_topk_pattern`` or ``index_topk_freq`` / ``index_skip_topk_offset``, not from ``indexer_types``)."""
    pattern = getattr(hf_config, "index_topk_pattern", None)
    if pattern is not None:
        return 0 <= layer < len(pattern) and pattern[layer] == "S"
    freq = getattr(hf_config, "index_topk_freq", INDEX_TOPK_FREQ_DEFAULT)
    offset = getattr(hf_config, "index_skip_topk_offset", INDEX_SKIP_TOPK_OFFSET_DEFAULT)
    return max(layer - offset + 1, 0) % freq != 0


def layers_without_indexer(hf_config: Any) -> tuple[int, ...]:
    """The decoder layers vllm-ascend builds without a DSA indexer (contract
    vllm-ascend-glm5-shared-layers-have-no-indexer): those that reuse top-k *and* that ``indexer_types``
    marks "shared". MTP layers always keep theirs."""
    kinds = getattr(hf_config, "indexer_types", None)
    if kinds is None:
        return ()
    layers = min(hf_config.num_hidden_layers, len(kinds))
    return tuple(
        i
        for i in range(layers)
        if reuses_topk(hf_config, i) and isinstance(kinds[i], str) and kinds[i].lower() == "shared"
    )


CONTRACTS = (
    Contract(
        id="vllm-ascend-requirements",
        component="vllm-ascend",
        path="requirements.txt",
        locator="file",
        symbol=None,
        line=1,
        sha256="0f6af90238084fed48486387cd10d03ef80677eede58a68a8a1ca95f279341bb",
        relied_on="vllm-ascend's requirements pin transformers==5.5.4 and arctic-inference==0.1.1 (removed by "
        "patches/vllm-ascend/0001-*, the stack pins transformers) and torchvision==0.25.0 / torchaudio==2.10.0 (the "
        "stack pins the same versions, from the CPU index on x86_64)",
        used_by="patches/vllm-ascend/, verl_npu/stack/stack.toml, tests_npu/stack/test_resolution.py",
        expects=(
            Expect("transformers==5.5.4", "the transformers pin our patch removes"),
            Expect("arctic-inference==0.1.1", "the plugin our patch removes"),
            Expect("torchvision==0.25.0", "the stack's torchvision pin"),
            Expect("torchaudio==2.10.0", "the stack's torchaudio pin"),
            Expect("torch-npu==2.10.0.post4", "the stack's torch-npu pin"),
        ),
    ),
    Contract(
        id="vllm-ascend-sleep-mode-refuses-expandable-segments",
        component="vllm-ascend",
        path="vllm_ascend/device_allocator/camem.py",
        locator="python",
        symbol="CaMemAllocator.__init__",
        line=151,
        sha256="e54b7f0af2e76b7d389e8991c32363de47dec20d03cc3dfd852975f10f39726e",
        relied_on=f"vLLM's sleep mode (CaMemAllocator, verl's default enable_sleep_mode=True) asserts that "
        f"{ALLOC_CONF_VARIABLE} does not contain {EXPANDABLE_SEGMENTS}",
        used_by="docker/Dockerfile.*, verl_npu/runtime_patches/ray_runtime_env.py, ci/nightly/nightly.env (never set "
        "it); verl_npu/doctor and verl_npu/preflight (flag it)",
        expects=(
            Expect(f'os.environ.get("{ALLOC_CONF_VARIABLE}", "")', "reads the allocator configuration"),
            Expect(f'assert "{EXPANDABLE_SEGMENTS}" not in conf', "refuses expandable segments"),
        ),
    ),
    Contract(
        id="vllm-ascend-expandable-segments-only-without-sleep-mode",
        component="vllm-ascend",
        path="vllm_ascend/platform.py",
        locator="python",
        symbol="NPUPlatform.check_and_update_config",
        line=450,
        sha256="6a9f20cd1f4281bfe7b578089df2d61cc3fa2a165e80ef2a0eb0b868ffd83464",
        relied_on=f"vllm-ascend turns {EXPANDABLE_SEGMENTS} on by itself only when sleep mode is off, and says not "
        "to set it for RL (sleep mode)",
        used_by="verl_npu/doctor and verl_npu/preflight (the fix they suggest: leave it unset)",
        expects=(
            Expect("if model_config and not model_config.enable_sleep_mode:", "only without sleep mode"),
            Expect("We should not set this environment variable in RL (sleep mode) scenarios.", "the upstream advice"),
        ),
    ),
    # --- GLM-5.2's shared DSA layers in the rollout ----------------------------------------------------------
    Contract(
        id="vllm-ascend-glm5-shared-layers-have-no-indexer",
        component="vllm-ascend",
        path=_GLM5_LAYERS_PATCH,
        locator="file",
        symbol=None,
        line=1,
        sha256="5293b70173bdad86c6e62cc9659263eba1eb35db9740ab7160659086a9e0dc1c",
        relied_on="vllm-ascend replaces vLLM's DeepseekV2MLAAttention.__init__ (GLM-5's attention): a decoder layer "
        "that reuses top-k (index_topk_pattern, or index_topk_freq / index_skip_topk_offset, defaults 1 / 2) and that "
        "indexer_types marks 'shared' has no Indexer, hence no indexer parameters (a weight sent for one raises "
        "KeyError in vLLM's loader); MTP layers keep theirs; the MLA parameters are fused_qkv_a_proj, q_a_layernorm, "
        "q_b_proj, kv_a_layernorm, kv_b_proj and o_proj",
        used_by="verl_npu/contracts/vllm_ascend.py (layers_without_indexer, MLA_PARAMETERS), "
        "verl_npu/engine/bridges/glm5.py (export_weights), tests_npu/engine/test_glm5_2_bridge.py",
        expects=(
            Expect("DeepseekV2MLAAttention.__init__ = _deepseek_v2_mla_attention_init", "replaces vLLM's layer"),
            Expect("if not skip_topk:\n        return False", "a layer computing its own top-k keeps its indexer"),
            Expect(
                "if num_hidden_layers is not None and layer_id >= num_hidden_layers:\n        return False",
                "MTP layers keep their indexer",
            ),
            Expect('return isinstance(indexer_type, str) and indexer_type.lower() == "shared"', "only 'shared' layers"),
            Expect('getattr(config,"index_topk_freq",1,)', "top-k frequency, default 1", ignore_whitespace=True),
            Expect('getattr(config,"index_skip_topk_offset",2,)', "top-k offset, default 2", ignore_whitespace=True),
            Expect(
                "_skip_topk=(max(layer_id-_index_skip_topk_offset+1,0,)%_index_topk_freq!=0)",
                "which layers reuse top-k",
                ignore_whitespace=True,
            ),
            Expect('_skip_topk = _index_topk_pattern[layer_id] == "S"', "or an explicit pattern"),
            Expect("if self.is_v32 and not skip_indexer_init:", "an indexer only where not skipped"),
            Expect("self.indexer = None", "no indexer module otherwise"),
            Expect("self.fused_qkv_a_proj = DeepSeekV2FusedQkvAProjLinear(", "q_a_proj and kv_a_proj_with_mqa fused"),
            Expect('prefix=f"{prefix}.kv_b_proj",', "kv_b_proj kept whole (the bridge merges MindSpeed's K and V)"),
        ),
    ),
    Contract(
        id="vllm-ascend-mla-latent-norms-use-rms-norm-eps",
        component="vllm-ascend",
        path=_GLM5_LAYERS_PATCH,
        locator="python",
        symbol="_deepseek_v2_mla_attention_init",
        line=48,
        sha256="4d5bf17e1136b929b6d57fc5975ef6bf829c5e27269eb8eee5c3b5e2ec552f00",
        relied_on="vllm-ascend's replacement of DeepseekV2MLAAttention.__init__ keeps vLLM's latent norms: "
        "q_a_layernorm and kv_a_layernorm are RMSNorms with the config's rms_norm_eps (1e-5 for GLM-5.2), which the "
        "engine's q_layernorm / kv_layernorm follow",
        used_by="verl_npu/engine/bridges/glm5.py (layernorm_epsilon), verl_npu/parity/independent.py (the latent "
        "norms' eps), tests_npu/parity/test_parity_independent.py, docs/parity.md",
        expects=(
            Expect(
                "self.q_a_layernorm=RMSNorm(self.q_lora_rank,eps=config.rms_norm_eps,)",
                "q latent: rms_norm_eps",
                ignore_whitespace=True,
            ),
            Expect(
                "self.kv_a_layernorm=RMSNorm(self.kv_lora_rank,eps=config.rms_norm_eps,)",
                "kv latent: rms_norm_eps",
                ignore_whitespace=True,
            ),
        ),
    ),
    Contract(
        id="vllm-ascend-glm5-layers-patch-applied",
        component="vllm-ascend",
        path="vllm_ascend/patch/worker/__init__.py",
        locator="grep",
        symbol=r'vllm_version_is\("0\.23\.0"\)|_V2_MODEL_RUNNER_SUPPORTED|patch_routed_experts_capture|patch_deepseek_v2',
        line=0,
        sha256="37d7d5b7426222e69638dfa3634c735764a70edf6b0c1d377bea205a91f3bd41",
        relied_on="vllm-ascend's worker patches always apply patch_deepseek_v2 (no indexer on shared layers); with "
        "vLLM 0.23.0 they do not import patch_routed_experts_capture (verl's GLM-5.2 patch imports it)",
        used_by="verl_npu/contracts/vllm_ascend.py (layers_without_indexer); verl 0.9.1 "
        "verl/utils/vllm/npu_vllm_patch.py (apply_npu_vllm_patches)",
        expects=(
            Expect(
                "vllm_ascend/patch/worker/__init__.py: import vllm_ascend.patch.worker.patch_deepseek_v2  # noqa",
                "imported unconditionally",
            ),
            Expect(
                'if vllm_version_is("0.23.0"):\nvllm_ascend/patch/worker/__init__.py: _V2_MODEL_RUNNER_SUPPORTED = '
                "False",
                "no V2 model runner with vLLM 0.23.0",
            ),
            Expect(
                "if _V2_MODEL_RUNNER_SUPPORTED:\nvllm_ascend/patch/worker/__init__.py: import "
                "vllm_ascend.patch.worker.patch_routed_experts_capture",
                "the routed-experts capture patch only with the V2 model runner",
            ),
        ),
    ),
    # --- verl 0.9.1's GLM-5.2 rollout patch (VERL_VLLM_ASCEND_GLM52_PATCH=1) --------------------------------
    Contract(
        id="vllm-ascend-rms-norm-adds-the-residual-in-the-fused-kernel",
        component="vllm-ascend",
        path="vllm_ascend/ops/layernorm.py",
        locator="python",
        symbol="AscendRMSNorm.forward_oot",
        line=63,
        sha256="16dac2ecdfbe1c5ddf29dd77c31f9032a6ecd98c6bbf4c153a45abde855f02df",
        relied_on="AscendRMSNorm.forward_oot adds the residual inside npu_add_rms_norm; verl's GLM-5.2 patch requires "
        "that kernel in this source (it raises otherwise) and replaces it with an explicit residual add then "
        "npu_rms_norm, keeping the maybe_chunk_residual op",
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (_patch_glm52_ascend_rms_norm), enabled by "
        "examples/glm5_2/glm5_2.env",
        expects=(
            Expect("npu_add_rms_norm", "the fused residual add verl's patch requires", ignore_whitespace=True),
            Expect("residual = torch.ops.vllm.maybe_chunk_residual(x, residual)", "the op verl's replacement calls"),
            Expect(
                "residual=x+residual",
                "the fix is not upstream at our pin: verl's patch applies it",
                present=False,
                ignore_whitespace=True,
            ),
            Expect(
                "npu_rms_norm(residual,self.weight",
                "the fix is not upstream at our pin: verl's patch applies it",
                present=False,
                ignore_whitespace=True,
            ),
        ),
    ),
    Contract(
        id="vllm-ascend-sfa-disposes-kv-b-proj",
        component="vllm-ascend",
        path=_SFA,
        locator="python",
        symbol="AscendSFAImpl.process_weights_after_loading",
        line=743,
        sha256="5995389614018ad83f196be9455fd257caadbae644fdc098e67c9fc70da4ea2e",
        relied_on="SFA (GLM-5's attention on Ascend) derives W_UK/W_UV from kv_b_proj after every load, copying into "
        "the same tensors on a reload, then disposes kv_b_proj through the module's dispose_layer; verl's GLM-5.2 "
        "patch keeps kv_b_proj for the next weight update, and silently does nothing if this call is gone",
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (_patch_glm52_sfa_kv_b_proj_disposal); "
        "verl_npu/engine/bridges/glm5.py (exports kv_b_proj every step)",
        expects=(
            Expect("dispose_layer(self.kv_b_proj)", "kv_b_proj disposed after loading", ignore_whitespace=True),
            Expect("assert isinstance(self.kv_b_proj.quant_method, UnquantizedLinearMethod)", "kv_b_proj is bf16"),
            Expect("self.W_UV.copy_(W_UV.transpose(0, 1).contiguous())", "a reload copies into the same W_UV"),
        ),
    ),
    Contract(
        id="vllm-ascend-sfa-indexer-weights-unscaled",
        component="vllm-ascend",
        path=_SFA,
        locator="python",
        symbol="AscendSFAImpl.indexer_select_post_process",
        line=1483,
        sha256="f272d908ced665edd622b1436a18168df2c4daa16a2f9853144037d671ad47cf",
        relied_on="SFA passes the indexer's head weights (kw[:, head_dim:]) to "
        "DeviceOperator.indexer_select_post_process without the n_heads**-0.5 * head_dim**-0.5 scale; verl's GLM-5.2 "
        "patch requires this source (it raises otherwise) and adds the scale in the device operator",
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (_patch_glm52_sfa_indexer_scale)",
        expects=(
            Expect("weights=kw[:,self.head_dim:]", "the head weights", ignore_whitespace=True),
            Expect(
                "DeviceOperator.indexer_select_post_process",
                "computed by the device operator",
                ignore_whitespace=True,
            ),
            Expect(
                "weights=weights*(self.n_head**-0.5)*(self.head_dim**-0.5)",
                "the fix is not upstream at our pin: verl's patch applies it",
                present=False,
                ignore_whitespace=True,
            ),
        ),
    ),
    Contract(
        id="vllm-ascend-device-operator-indexer-post-process",
        component="vllm-ascend",
        path=_DEVICE_OP,
        locator="python",
        symbol="BaseDeviceAdaptor.indexer_select_post_process",
        line=576,
        sha256="6e43fd74d530c99f2b7e23967346c5cd8ad77ed637dae9bee436d3f41c120a12",
        relied_on="the A2/A3 device operator's indexer_select_post_process takes (sfa_impl, q_li, q_li_scale, "
        "q_li_shape_ori, weights, ...): verl's GLM-5.2 patch checks this prefix and scales weights before calling it",
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (_patch_glm52_sfa_indexer_scale)",
        expects=(
            Expect(
                "def indexer_select_post_process(\n        sfa_impl,\n        q_li: torch.Tensor,\n        q_li_scale: "
                "torch.Tensor | None,\n        q_li_shape_ori: tuple[Any, ...] | None,\n        weights: torch.Tensor,",
                "the parameters verl's patch checks",
            ),
        ),
    ),
    Contract(
        id="vllm-ascend-device-operator-on-a2-a3",
        component="vllm-ascend",
        path=_DEVICE_OP,
        locator="python",
        symbol="get_device_adaptor",
        line=2111,
        sha256="bc5f9626ab02562c7a7db3f5b9898d9ca80366569d5e265f68ee5dc41c026b34",
        relied_on="DeviceOperator is BaseDeviceAdaptor on A2 and A3 (A5 and 310P get their own adaptors)",
        used_by="verl_npu/contracts/vllm_ascend.py (vllm-ascend-device-operator-indexer-post-process)",
        expects=(
            Expect("return A5DeviceAdaptor", "A5 has its own"),
            Expect("return Ascend310PDeviceAdaptor", "310P has its own"),
            Expect("return BaseDeviceAdaptor", "every other chip (A2, A3) gets the base adaptor", match="ends-with"),
        ),
    ),
    Contract(
        id="vllm-ascend-sfa-imports-device-operator",
        component="vllm-ascend",
        path=_SFA,
        locator="grep",
        symbol="import DeviceOperator",
        line=0,
        sha256="303dacd6a6ad5cc6db474f795cf8b16739752b12612ed1f4782f1f768328bfda",
        relied_on="sfa_v1's DeviceOperator is device_op's (the class verl's GLM-5.2 patch changes through sfa_v1)",
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (_patch_glm52_sfa_indexer_scale)",
        expects=(Expect("from vllm_ascend.device.device_op import DeviceOperator", "the same class object"),),
    ),
    Contract(
        id="vllm-ascend-camem-sleep-unmaps-without-synchronizing",
        component="vllm-ascend",
        path="vllm_ascend/device_allocator/camem.py",
        locator="python",
        symbol="CaMemAllocator.sleep",
        line=180,
        sha256="9972487ebd91d0bef33c8c896f2493fd5a5c0ddf500739c137743daa6b6a2a77",
        relied_on="CaMemAllocator.sleep unmaps every allocation without waiting for the NPU work still using it; "
        "verl's GLM-5.2 patch synchronizes the NPU before it",
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (patch_camem_sleep)",
        expects=(
            Expect("unmap_and_release(handle)", "unmaps the memory"),
            Expect("torch.npu.synchronize()", "no synchronization at our pin", present=False),
        ),
    ),
    Contract(
        id="vllm-ascend-routed-experts-capture-patch",
        component="vllm-ascend",
        path="vllm_ascend/patch/worker/patch_routed_experts_capture.py",
        locator="file",
        symbol=None,
        line=1,
        sha256="697d0688c8a3d71aa4ece2d578cf0d4ee59123d1a6dc3ed453187a498826584d",
        relied_on="importing patch_routed_experts_capture replaces vLLM's RoutedExpertsCapturer.capture with the "
        "Ascend one (verl's GLM-5.2 patch imports it: vllm-ascend does not with vLLM 0.23.0)",
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (apply_npu_vllm_patches); "
        "verl_npu/preflight/router_replay.py (which capture is in force)",
        expects=(
            Expect(
                "from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer",
                "the vLLM class it patches (contract vllm-routed-experts-capturer)",
            ),
            Expect("RoutedExpertsCapturer.capture = capture", "replaced at import"),
        ),
    ),
    # --- the rollout as preflight models it (verl_npu/preflight/rollout.py, docs/preflight_rollout.md) ----------
    Contract(
        id="vllm-ascend-dsa-kv-cache-per-layer",
        component="vllm-ascend",
        path=_MODEL_RUNNER,
        locator="python",
        symbol="NPUModelRunner.get_kv_cache_spec",
        line=4907,
        sha256="73851d129bd563bb19d8752f60d2f13c28b8ed0f0ed16a383b9c22a77d768b0d",
        relied_on="for a DSA model (hf config with index_topk) every MLA layer gets an AscendMLAAttentionSpec of one "
        "KV head (the latent is replicated over TP) whose head is (kv_lora_rank, qk_rope_head_dim, index_head_dim) "
        "on a layer with an indexer and (kv_lora_rank, qk_rope_head_dim, 0) on one that reuses another's top-k "
        "(GLM-5.2's shared layers), in the KV cache dtype",
        used_by="verl_npu/preflight/rollout.py (kv_bytes_per_token)",
        expects=(
            Expect("elif has_indexer:\n                        sparse_head_dim = self.sparse_head_dim", "full layers"),
            Expect(
                "self.model_config.hf_text_config.kv_lora_rank,\n                            "
                "self.model_config.hf_text_config.qk_rope_head_dim,\n                            0,",
                "layers without an indexer cache the latent and rope key only",
            ),
            Expect("num_kv_heads=1,\n                        head_size=sum(sparse_head_dim),", "one replicated head"),
            Expect("dtype=self.kv_cache_dtype,", "in the KV cache dtype"),
        ),
    ),
    Contract(
        id="vllm-ascend-dsa-sparse-head-dim",
        component="vllm-ascend",
        path=_MODEL_RUNNER,
        locator="grep",
        symbol=r"self\.sparse_head_dim = \(|hf_text_config\.(kv_lora_rank|qk_rope_head_dim|index_head_dim),$",
        line=0,
        sha256="5e95639f208ebc64f0dfa933dd6ca3aba583508cdbecbbd3b67171e5f2ac3620",
        relied_on="off the A5's SFA C8 path, a DSA model's full-layer KV head is (kv_lora_rank, qk_rope_head_dim, "
        "index_head_dim)",
        used_by="verl_npu/preflight/rollout.py (kv_bytes_per_token)",
        expects=(
            Expect(
                "self.sparse_head_dim = (\n"
                + _MODEL_RUNNER
                + ": self.model_config.hf_text_config.kv_lora_rank,\n"
                + _MODEL_RUNNER
                + ": self.model_config.hf_text_config.qk_rope_head_dim,\n"
                + _MODEL_RUNNER
                + ": self.model_config.hf_text_config.index_head_dim,",
                "latent, rope key, indexer key",
            ),
        ),
    ),
    Contract(
        id="vllm-ascend-mla-spec-page-size",
        component="vllm-ascend",
        path=_KV_SPEC,
        locator="python",
        symbol="AscendMLAAttentionSpec.page_size_bytes",
        line=67,
        sha256="254a99da579b20b5045799f47d089e0c893c8c1edee225ad034f2f8e67446964",
        relied_on="without C8 quantization or DCP, a block of an AscendMLAAttentionSpec takes block_size x "
        "num_kv_heads x head_size x the dtype's bytes (scale_dim is 0)",
        used_by="verl_npu/preflight/rollout.py (kv_bytes_per_token, RolloutEstimate.needed_kv_bytes)",
        expects=(
            Expect(
                "return (\n            self.block_size\n            * self.num_kv_heads\n            * (self.head_size "
                "* get_dtype_size(self.dtype) + self.scale_dim * get_dtype_size(self.scale_dtype))\n        )",
                "the plain layout",
                match="ends-with",
            ),
        ),
    ),
    Contract(
        id="vllm-ascend-mla-spec-whole-blocks",
        component="vllm-ascend",
        path=_KV_SPEC,
        locator="python",
        symbol="AscendMLAAttentionSpec.max_memory_usage_bytes",
        line=241,
        sha256="af7809ec0d9ea013e4d081e85064a4a73031506136ede777cc3825cdcfbe7a1d",
        relied_on="one request of max_model_len tokens takes cdiv(max_model_len, block_size) whole pages on a layer "
        "(no DCP / PCP, compress ratio 1)",
        used_by="verl_npu/preflight/rollout.py (RolloutEstimate.needed_kv_bytes, largest_fitting_len)",
        expects=(
            Expect(
                "return cdiv(max_model_len, self.block_size * self.compress_ratio) * self.page_size_bytes",
                "whole blocks",
            ),
        ),
    ),
    Contract(
        id="vllm-ascend-block-size-128",
        component="vllm-ascend",
        path="vllm_ascend/utils.py",
        locator="python",
        symbol="refresh_block_size",
        line=1369,
        sha256="e5c6edfa5a87c5e0d32f093d0d95018b06eecf19214b0860d683682c9c33295b",
        relied_on="the KV cache block is 128 tokens unless set, and 128 whenever prefix caching or chunked prefill "
        "is on (verl turns both on by default)",
        used_by="verl_npu/preflight/rollout.py (ASCEND_BLOCK_SIZE)",
        expects=(
            Expect("if cache_config.block_size is None:\n        cache_config.block_size = 128", "the default"),
            Expect(
                "if cache_config.enable_prefix_caching or scheduler_config.enable_chunked_prefill:",
                "forced with prefix caching or chunked prefill",
            ),
        ),
    ),
    Contract(
        id="vllm-ascend-dsa-kv-cache-in-model-dtype",
        component="vllm-ascend",
        path="vllm_ascend/platform.py",
        locator="python",
        symbol="NPUPlatform.check_and_update_config",
        line=450,
        sha256="6a9f20cd1f4281bfe7b578089df2d61cc3fa2a165e80ef2a0eb0b868ffd83464",
        relied_on="a DSA model's KV cache takes the model's dtype; with piecewise graphs the graph is split only at "
        "the attention ops (vllm::mla_forward, vllm::dsa_forward added to vLLM's), so the MoE layers are inside "
        "captured graphs in every mode with graphs; enforce_eager captures none",
        used_by="verl_npu/preflight/rollout.py (kv_bytes_per_token, graph_checks)",
        expects=(
            Expect(
                'if model_config and hasattr(model_config.hf_text_config, "index_topk"):\n            '
                'vllm_config.cache_config.cache_dtype = str(model_config.dtype).replace("torch.", "")',
                "KV cache in the model dtype",
            ),
            Expect(
                'compilation_config.splitting_ops.extend(\n                [\n                    "vllm::mla_forward",'
                '\n                    "vllm::dsa_forward",\n                ]\n            )',
                "pieces split at attention",
            ),
            Expect("compilation_config.mode = CompilationMode.NONE", "eager: no compilation, no graphs"),
        ),
    ),
    Contract(
        id="vllm-ascend-kv-cache-budget",
        component="vllm-ascend",
        path="vllm_ascend/worker/worker.py",
        locator="python",
        symbol="NPUWorker.determine_available_memory",
        line=527,
        sha256="1ec4d18d07a9a1b34ed718b57ba3114ece9753fc01d005cf1f63999400a173b6",
        relied_on="the KV cache gets the requested memory (gpu_memory_utilization x the device's total) less the "
        "weights, the profiling run's torch peak and the non-torch memory",
        used_by="verl_npu/preflight/rollout.py (RolloutEstimate.available_kv_bytes)",
        expects=(
            Expect(
                "profile_result.non_torch_increase + profile_result.torch_peak_increase + "
                "profile_result.weights_memory",
                "what is not KV cache",
            ),
            Expect(
                "self.available_kv_cache_memory_bytes = self.requested_memory - profile_result.non_kv_cache_memory",
                "the KV cache's budget",
            ),
        ),
    ),
    Contract(
        id="vllm-ascend-requested-memory",
        component="vllm-ascend",
        path="vllm_ascend/worker/worker.py",
        locator="grep",
        symbol=r"self\.requested_memory = ",
        line=0,
        sha256="fdb7122a0c24d02d8510a7a0900fd5758cddaec11c952286afd051547560d879",
        relied_on="the memory vLLM may use on a device is gpu_memory_utilization x its total memory",
        used_by="verl_npu/preflight/rollout.py (RolloutEstimate.requested_bytes)",
        expects=(
            Expect(
                "self.requested_memory = self.init_snapshot.total_memory * self.cache_config.gpu_memory_utilization",
                "utilization x total",
            ),
        ),
    ),
    Contract(
        id="vllm-ascend-moe-weights-after-loading",
        component="vllm-ascend",
        path="vllm_ascend/ops/fused_moe/fused_moe.py",
        locator="python",
        symbol="AscendUnquantizedFusedMoEMethod.process_weights_after_loading",
        line=112,
        sha256="5e161cb7dd63aed6191759aeb3c042aecdd454c055fb47b9fd6eec12bcc38e68",
        relied_on="after every load (at start, and after each of verl's weight syncs) the experts become new "
        "Parameters over w13/w2 transposed and made contiguous: the same storage when the loaded tensor is the "
        "transposed view the wake-up made (contiguous() of a contiguous tensor is itself), so graphs captured at "
        "start still read them; with fused MC2 on they are cast to FRACTAL_NZ into new storage, which those graphs "
        "do not read; NZ for bf16 weights only with weight_nz_mode 2",
        used_by="verl_npu/preflight/rollout.py (graph_checks), examples/glm5_2/glm5_2.env",
        expects=(
            Expect(
                "w13_data = self._maybe_pad_weight(layer.w13_weight.data).transpose(1, 2).contiguous()",
                "w13 transposed and made contiguous",
            ),
            Expect("layer.w13_weight = torch.nn.Parameter(w13_data, requires_grad=False)", "a new Parameter"),
            Expect(
                "w2_data = self._maybe_pad_weight(layer.w2_weight.data).transpose(1, 2).contiguous()",
                "w2 likewise",
            ),
            Expect(
                "if enable_fused_mc2:\n            layer.w13_weight.data = torch_npu.npu_format_cast("
                "layer.w13_weight.data, ACL_FORMAT_FRACTAL_NZ)",
                "fused MC2 recasts into new storage",
            ),
            Expect("layer.w13_weight.data = maybe_trans_nz(layer.w13_weight.data)", "otherwise NZ only if asked"),
        ),
    ),
    Contract(
        id="vllm-ascend-wake-up-transposes-experts-back",
        component="vllm-ascend",
        path="vllm_ascend/worker/worker.py",
        locator="python",
        symbol="NPUWorker.wake_up",
        line=241,
        sha256="004701116111aaf96589eb4a68dfb168ed89d1bf8d8666ba2760f20ed811a8ad",
        relied_on="waking the weights up gives w13/w2 back the loader's layout as a transposed view of the same "
        "storage (unquantized models), and refuses to run with NZ weights (weight_nz_mode not 0) in RL",
        used_by="verl_npu/preflight/rollout.py (graph_checks)",
        expects=(
            Expect('elif "w13_weight" in name and param.shape[1] == hidden_size:', "w13 in the kernel's layout"),
            Expect("w13_data = param.transpose(1, 2)", "a view, no copy"),
            Expect("w2_data = param.transpose(1, 2)", "w2 likewise"),
            Expect(
                'if nz_mode:\n            raise ValueError(\n                "FRACTAL_NZ mode is enabled.',
                "NZ weights refused",
            ),
        ),
    ),
    Contract(
        id="vllm-ascend-weights-nz-only-when-asked",
        component="vllm-ascend",
        path="vllm_ascend/utils.py",
        locator="python",
        symbol="_should_trans_nz",
        line=261,
        sha256="ee6ed63bcda6f4c4022efbecaad62c9035882831a7f1079b13bd8cdaca0937d1",
        relied_on="bf16 weights go to FRACTAL_NZ only with weight_nz_mode 2 (0: never), off the 310P",
        used_by="verl_npu/preflight/rollout.py (graph_checks)",
        expects=(
            Expect("if not nz_mode:\n        return False", "mode 0: never"),
            Expect("if weight.dtype in {torch.bfloat16, torch.float16}:\n        return nz_mode == 2", "bf16: mode 2"),
        ),
    ),
    Contract(
        id="vllm-ascend-nz-and-fused-mc2-defaults",
        component="vllm-ascend",
        path="vllm_ascend/envs.py",
        locator="grep",
        symbol=r'"VLLM_ASCEND_ENABLE_(NZ|FUSED_MC2)": ',
        line=0,
        sha256="a7d0d9fce044007243b7b332a27c082bd464fb542fa349eb177350b3c3872aff",
        relied_on="VLLM_ASCEND_ENABLE_NZ defaults to 1 (verl sets 0 in vLLM's workers when unset) and "
        "VLLM_ASCEND_ENABLE_FUSED_MC2 to 0; additional_config's weight_nz_mode / enable_fused_mc2 win over them",
        used_by="verl_npu/preflight/rollout.py (graph_checks), examples/glm5_2/glm5_2.env",
        expects=(
            Expect('"VLLM_ASCEND_ENABLE_NZ": lambda: int(os.getenv("VLLM_ASCEND_ENABLE_NZ", 1)),', "NZ default 1"),
            Expect(
                '"VLLM_ASCEND_ENABLE_FUSED_MC2": lambda: int(os.getenv("VLLM_ASCEND_ENABLE_FUSED_MC2", "0")),',
                "fused MC2 default 0",
            ),
        ),
    ),
    Contract(
        id="vllm-ascend-sleep-copies-each-allocation-to-pinned-memory",
        component="vllm-ascend",
        path="vllm_ascend/device_allocator/camem.py",
        locator="python",
        symbol="CaMemAllocator.sleep",
        line=180,
        sha256="9972487ebd91d0bef33c8c896f2493fd5a5c0ddf500739c137743daa6b6a2a77",
        relied_on="sleep copies every allocation with an offloaded tag (level 1: 'weights') to a pinned host tensor "
        "of its own, one per allocation; wake_up drops the reference, and torch's pinned allocator keeps the block",
        used_by="verl_npu/preflight/rollout.py (RolloutEstimate.host_bytes_per_rank), verl_npu/preflight/memory.py",
        expects=(
            Expect("if data.tag in offload_tags:", "the offloaded tags only"),
            Expect(
                'cpu_backup_tensor = torch.empty(size_in_bytes, dtype=torch.uint8, device="cpu", pin_memory=True)',
                "one pinned block per allocation",
            ),
        ),
    ),
    # --- R3: the routes the rollout took (verl_npu/preflight/router_replay.py, docs/preflight_rollout.md) -----
    Contract(
        id="vllm-ascend-runner-makes-the-routes-capturer-with-the-kv-cache",
        component="vllm-ascend",
        path=_MODEL_RUNNER,
        locator="grep",
        symbol=r"^class NPUModelRunner\(|init_routed_experts_capturer",
        line=0,
        sha256="fc29c7363bdc9a15f939369922d617ea584217d212e25f36e2ff308fdf072db5",
        relied_on="the NPU model runner is vLLM's GPU model runner subclassed: once the KV cache exists and "
        "enable_return_routed_experts is on it calls vLLM's own init_routed_experts_capturer (it defines none), which "
        "makes the capturer and hands it to the runner's _bind_routed_experts_capturer",
        used_by="verl_npu/preflight/router_replay.py (the R3 rollout check's capture path)",
        expects=(
            Expect("class NPUModelRunner(GPUModelRunner):", "vLLM's runner underneath"),
            Expect("self.init_routed_experts_capturer()", "the capturer is made after the KV cache"),
            Expect("def init_routed_experts_capturer", "vLLM's method, not a replacement", present=False),
        ),
    ),
    Contract(
        id="vllm-ascend-runner-binds-the-routes-capturer-to-every-fused-moe",
        component="vllm-ascend",
        path=_MODEL_RUNNER,
        locator="python",
        symbol="NPUModelRunner._bind_routed_experts_capturer",
        line=3887,
        sha256="7b3b21459f47b107a6b766024f4e805e9e2f309d961c7b9ee28154323df59313",
        relied_on="with vLLM 0.23.0 the NPU runner stores the capturer on every FusedMoE module of the compilation "
        "context (vllm-ascend's routing never calls vLLM's router hook, where vLLM's GPU runner binds it)",
        used_by="verl_npu/preflight/router_replay.py (the R3 rollout check's capture path), "
        "tests_npu/preflight/test_preflight_router_replay.py (executes it)",
        expects=(
            Expect('if vllm_version_is("0.23.0"):', "the vLLM 0.23.0 branch"),
            Expect(
                "for module in self.compilation_config.static_forward_context.values(): if isinstance(module, "
                "FusedMoE): module._ascend_routed_experts_capturer = capturer",
                "every FusedMoE layer gets the capturer",
                ignore_whitespace=True,
            ),
        ),
    ),
    Contract(
        id="vllm-ascend-unquantized-moe-captures-the-routes-it-dispatches",
        component="vllm-ascend",
        path="vllm_ascend/ops/fused_moe/fused_moe.py",
        locator="python",
        symbol="AscendUnquantizedFusedMoEMethod.apply",
        line=141,
        sha256="4c19758d35c3ac4b049f32a6dea8c46c281d12f65e4768b6e5641474ddb8e1c4",
        relied_on="the unquantized MoE method selects the experts and, when enable_return_routed_experts is on, hands "
        "the capturer the same topk_ids (before the zero-expert rewrite) with the layer's absolute index",
        used_by="verl_npu/preflight/router_replay.py (R3 on Ascend needs the unquantized rollout), "
        "tests_npu/preflight/test_preflight_router_replay.py (executes it)",
        expects=(
            Expect("topk_weights, topk_ids = select_experts(", "the routes are chosen here"),
            Expect(
                'if vllm_version_is("0.23.0"): model_config = layer.vllm_config.model_config',
                "reads the switch from the layer's config on vLLM 0.23.0",
                ignore_whitespace=True,
            ),
            Expect(
                "if model_config is not None and model_config.enable_return_routed_experts: capturer = getattr(layer, "
                '"_ascend_routed_experts_capturer", None) if capturer is not None: capturer.capture(layer_id='
                "layer.layer_id, topk_ids=topk_ids) if zero_expert_num > 0",
                "captures the selected routes, before anything rewrites them",
                ignore_whitespace=True,
            ),
        ),
    ),
    Contract(
        id="vllm-ascend-quantized-moe-methods-never-capture",
        component="vllm-ascend",
        path="vllm_ascend/quantization",
        locator="grep",
        symbol=r"select_experts\(|capture|routed_experts",
        line=0,
        sha256="e5ff8f4955bff04095510899e7389eafe9ed8294c08290aab1c7ce4982ee212f",
        relied_on="the quantized MoE methods (w8a8_dynamic, w4a8, w4a16, the MXFP ones and those deriving from them) "
        "select their experts themselves and never call the route capturer: a quantized rollout returns expert 0 "
        "for every route",
        used_by="verl_npu/preflight/router_replay.py (R3 with a quantized rollout is a FAIL)",
        expects=(
            Expect(
                "vllm_ascend/quantization/methods/w8a8_dynamic.py: topk_weights, topk_ids = select_experts(",
                "the quantized methods route by themselves",
            ),
            Expect("capture", "no quantized method captures the routes", present=False),
            Expect("routed_experts", "nor reads the capturer", present=False),
        ),
    ),
    Contract(
        id="vllm-ascend-ep-moe-communication",
        component="vllm-ascend",
        path="vllm_ascend/ascend_forward_context.py",
        locator="python",
        symbol="select_moe_comm_method",
        line=303,
        sha256="902afb790af0f4712cf9e4c66b0b360a67b35180340c3600078c403547c6e719",
        relied_on="without expert parallelism (or with an EP group of one) the MoE layers all-gather the tokens, which "
        "keeps each rank's whole step; with EP on A2/A3 they use MC2 or all-to-all (A3 by step size, "
        "_select_a3_moe_comm_method; A2 MC2 for small steps on large EP groups)",
        used_by="verl_npu/preflight/router_replay.py (when the TP ranks route slices of a step)",
        expects=(
            Expect(
                "if not vllm_config.parallel_config.enable_expert_parallel or get_ep_group().world_size == 1: "
                "moe_comm_type = MoECommType.ALLGATHER",
                "no EP: all-gather",
                ignore_whitespace=True,
            ),
            Expect("moe_comm_type = _select_a3_moe_comm_method(", "A3 with EP: its own choice"),
            Expect("moe_comm_type = _select_a2_moe_comm_method(", "A2 with EP: its own choice"),
        ),
    ),
    Contract(
        id="vllm-ascend-all2all-moe-routes-a-tp-slice",
        component="vllm-ascend",
        path="vllm_ascend/ops/fused_moe/prepare_finalize.py",
        locator="python",
        symbol="PrepareAndFinalizeWithAll2All.prepare",
        line=132,
        sha256="8103d5eb4eb4a1611b4ab9e982dd968cf4f8dfbbf0677ed0e7ef45dede0c7cd5",
        relied_on="before routing, the all-to-all MoE pads the step to at least TP rows and gives each TP rank "
        "tensor_split(tokens, TP)[rank], so a rank routes only its slice",
        used_by="verl_npu/preflight/router_replay.py (R3 with rollout EP > 1 and TP > 1), "
        "tests_npu/preflight/test_preflight_router_replay.py (executes it)",
        expects=(
            Expect(
                "split_hidden_states = torch.tensor_split(hidden_states, self.tp_size, dim=0)",
                "the step split over TP",
            ),
            Expect("router_logits = split_router_logits[self.tp_rank]", "a rank routes its slice"),
        ),
    ),
    Contract(
        id="vllm-ascend-mc2-moe-routes-a-tp-slice",
        component="vllm-ascend",
        path="vllm_ascend/ops/fused_moe/prepare_finalize.py",
        locator="python",
        symbol="PrepareAndFinalizeWithMC2.prepare",
        line=249,
        sha256="47dba44a5f0f843190dd52e13f5eae1f9955bf13e6cde54f60c7717dc1242d73",
        relied_on="MC2 pads the step to the padded token count and gives each TP rank tensor_split(tokens, TP)[rank] "
        "before routing",
        used_by="verl_npu/preflight/router_replay.py (R3 with rollout EP > 1 and TP > 1)",
        expects=(
            Expect("target_pad_length = _EXTRA_CTX.padded_num_tokens", "padded first"),
            Expect(
                "split_hidden_states = torch.tensor_split(hidden_states, self.tp_size, dim=0)",
                "the step split over TP",
            ),
            Expect("router_logits = split_router_logits[self.tp_rank]", "a rank routes its slice"),
        ),
    ),
    Contract(
        id="vllm-ascend-routes-capture-patch-only-for-vllm-main",
        component="vllm-ascend",
        path="vllm_ascend/patch/worker/__init__.py",
        locator="file",
        symbol=None,
        line=1,
        sha256="87b23b247f1f38d0599de81232d5c434bd9bbe24ff950150f16a12d2a37122e9",
        relied_on="vllm-ascend's worker patches import its routes capture (patch_routed_experts_capture) only with "
        "the V2 model runner, which they turn off for vLLM 0.23.0: on this stack vLLM's own capture is in force unless "
        "something else imports vllm-ascend's (verl's GLM-5.2 patch does)",
        used_by="verl_npu/preflight/router_replay.py (R3 with rollout TP > 1 and EP > 1 needs verl's GLM-5.2 patch)",
        expects=(
            Expect(
                'if vllm_version_is("0.23.0"):\n    _V2_MODEL_RUNNER_SUPPORTED = False',
                "no V2 model runner with vLLM 0.23.0",
            ),
            Expect(
                "if _V2_MODEL_RUNNER_SUPPORTED:\n    import vllm_ascend.patch.worker.patch_routed_experts_capture",
                "the capture imported under the V2 runner's switch",
            ),
            Expect(
                "\nimport vllm_ascend.patch.worker.patch_routed_experts_capture",
                "never imported unconditionally",
                present=False,
            ),
        ),
    ),
    Contract(
        id="vllm-ascend-routes-capture-gathers-tp-slices",
        component="vllm-ascend",
        path="vllm_ascend/patch/worker/patch_routed_experts_capture.py",
        locator="python",
        symbol="capture",
        line=35,
        sha256="11807157678edccce3975a36d099a19da9070be68ff8ae5443204140f2d27bac",
        relied_on="vllm-ascend's capture accepts, under data parallelism, the uneven all-to-all slices (ceil or floor "
        "of tokens / TP) and the MC2-padded ones, all-gathers them over the TP group and keeps the DP rank's tokens; "
        "without DP metadata it keeps whatever the rank routed",
        used_by="verl_npu/preflight/router_replay.py (R3 needs it with rollout TP > 1 and EP > 1), "
        "tests_npu/preflight/test_preflight_router_replay.py (executes it)",
        expects=(
            Expect(
                "if ctx.dp_metadata is None:  # single dp\n        start_loc = 0\n        end_loc = topk_ids.shape[0]",
                "one DP rank: no gather",
            ),
            Expect("n == (token_num_per_dp + self.tp_size - 1) // self.tp_size", "the longer all-to-all slice"),
            Expect("or n == token_num_per_dp // self.tp_size", "the shorter all-to-all slice (vLLM's capture raises)"),
            Expect("or n == (max_tokens + self.tp_size - 1) // self.tp_size", "an MC2-padded slice"),
            Expect(
                "dist.all_gather(list(split_topk_ids), topk_ids, get_tp_group().device_group)",
                "gathered over the TP group",
            ),
        ),
    ),
)

# verl 0.9.1's GLM-5.2 patch: each vllm-ascend object it reads, replaces or imports (as verl names it) -> the
# contracts on it (tests_npu/contracts/test_contracts.py checks that these cover every target and every check of
# verl's patch).
VERL_GLM52_PATCH_TARGETS = {
    "vllm_ascend.ops.layernorm.AscendRMSNorm.forward_oot": (
        "vllm-ascend-rms-norm-adds-the-residual-in-the-fused-kernel",
    ),
    "vllm_ascend.attention.sfa_v1.AscendSFAImpl.process_weights_after_loading": ("vllm-ascend-sfa-disposes-kv-b-proj",),
    "vllm_ascend.attention.sfa_v1.dispose_layer": ("vllm-ascend-sfa-disposes-kv-b-proj",),
    "vllm_ascend.attention.sfa_v1.AscendSFAImpl.indexer_select_post_process": (
        "vllm-ascend-sfa-indexer-weights-unscaled",
    ),
    "vllm_ascend.attention.sfa_v1.DeviceOperator.indexer_select_post_process": (
        "vllm-ascend-device-operator-indexer-post-process",
        "vllm-ascend-device-operator-on-a2-a3",
        "vllm-ascend-sfa-imports-device-operator",
    ),
    "vllm_ascend.device_allocator.camem.CaMemAllocator.sleep": (
        "vllm-ascend-camem-sleep-unmaps-without-synchronizing",
    ),
    "vllm_ascend.patch.worker.patch_routed_experts_capture": (
        "vllm-ascend-routed-experts-capture-patch",
        "vllm-ascend-glm5-layers-patch-applied",
        "vllm-routed-experts-capturer",
    ),
}
