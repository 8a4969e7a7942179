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
# tests_npu/test_contracts.py reads both from verl's source.
GLM52_PATCH_VARIABLE = "VERL_VLLM_ASCEND_GLM52_PATCH"
GLM52_PATCH_ON_VALUES = ("1", "true", "yes")

_SFA = "vllm_ascend/attention/sfa_v1.py"
_DEVICE_OP = "vllm_ascend/device/device_op.py"
_GLM5_LAYERS_PATCH = "vllm_ascend/patch/worker/patch_deepseek_v2.py"

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
        used_by="patches/vllm-ascend/, verl_npu/stack/stack.toml, tests_npu/test_resolution.py",
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
        "verl_npu/engine/bridges/glm5.py (export_weights), tests_npu/test_glm5_2_bridge.py",
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
        used_by="verl 0.9.1 verl/utils/vllm/npu_vllm_patch.py (apply_npu_vllm_patches)",
        expects=(
            Expect(
                "from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer",
                "the vLLM class it patches (contract vllm-routed-experts-capturer)",
            ),
            Expect("RoutedExpertsCapturer.capture = capture", "replaced at import"),
        ),
    ),
)

# verl 0.9.1's GLM-5.2 patch: each vllm-ascend object it reads, replaces or imports (as verl names it) -> the
# contracts on it (tests_npu/test_contracts.py checks that these cover every target and every check of verl's patch).
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
