"""mbridge bridge for GLM-5 / GLM-5.x (HF ``glm_moe_dsa``): MLA + MoE + DeepSeek sparse attention (DSA).

mbridge 0.15.1 has no ``glm_moe_dsa`` bridge, so verl's vanilla-mbridge path cannot build GLM-5.
:class:`GLM5Bridge` extends mbridge's DeepSeek-V3 bridge (same MLA and MoE weight tables) with

* the config mapping to megatron-core 0.18's ``MLATransformerConfig``, DSA included
  (``experimental_attention_variant="dsa"``, indexer heads, head dim and top-k) and GLM-5's router;
* HF <-> megatron names for the DSA indexer (``self_attn.indexer.*`` <->
  ``self_attention.core_attention.indexer.*``), for the local spec's separate q/kv norms and
  SequentialMLP experts (verl_npu.engine.layer_spec) besides TransformerEngine's names, and for
  MindSpeed's absorbed MLA (``use_dsa_absorb``: ``linear_k_up_proj`` + ``linear_v_up_proj`` <->
  ``kv_b_proj``, per-head interleaved, see verl_npu.engine.bridges.absorbed_mla);
* the RoPE layouts megatron computes with. Its MLA and DSA indexer rotate interleaved pairs
  (2i, 2i+1), and its indexer puts the rotary dims after the others. GLM-5 checkpoints put the
  indexer's rotary dims first. ``rope_interleave`` / ``indexer_rope_interleave`` say which pairs the
  checkpoint rotates: true (GLM-5.2's published config; also what an absent flag means, as vLLM
  reads it) is megatron's order, false (half-split pairs (i, i+d/2), what transformers 5.10's
  GlmMoeDsa computes whatever the config says) needs the rotary rows reordered. Rows are permuted
  on load and back on export, so exported weights equal the checkpoint's.

GLM-5.2 (same ``glm_moe_dsa`` type): its "shared" DSA layers (``indexer_types``) are built without an
indexer (verl_npu.engine.index_share), like the published checkpoint, which ships no indexer tensors
for them, and like vLLM's model under vllm-ascend, which has no indexer parameters there (contract
vllm-ascend-glm5-shared-layers-have-no-indexer): nothing reads or exports them. The FP8 release
(e4m3 weights with 128x128 block scales) is dequantised to bf16 on load
(verl_npu.engine.bridges.fp8_safetensors). The MTP layer (``num_nextn_predict_layers``, checkpoint
layer ``num_hidden_layers``) is neither built nor loaded: RL does not train it, and vLLM's main model
skips its weights (contract vllm-deepseek-v2-weight-names).

Refused with an error: rope types other than "default"; a router that megatron cannot express.
"""

from __future__ import annotations

import collections
import logging
import re
from typing import ClassVar

import torch
from mbridge.core import LLMBridge, register_model
from mbridge.core.bridge import _MODEL_REGISTRY
from mbridge.core.util import unwrap_model
from mbridge.models.deepseek_v3 import DeepseekV3Bridge

from verl_npu import platform as _platform
from verl_npu.contracts.vllm import moe_layers as vllm_moe_layers
from verl_npu.contracts.vllm_ascend import layers_without_indexer
from verl_npu.engine.bridges import fast_export, fast_load
from verl_npu.engine.bridges.absorbed_mla import merge_kv_b_proj, split_kv_b_proj
from verl_npu.engine.bridges.fast_read import ParallelSafeTensorIO, TensorReads
from verl_npu.engine.bridges.fp8_safetensors import BlockFP8SafeTensorIO, is_fp8_block_scaled
from verl_npu.engine.bridges.hf_save import SavesWhatIsExported
from verl_npu.models.glm5.config import (
    MODEL_TYPE,
    SHARED,
    glm5_config_fields,
    indexer_types,
    moe_layer_freq,
    rope_parameters,
)

logger = logging.getLogger(__name__)

_LAYER_PARAM = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_CHECKPOINT_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_TE_EXPERT = re.compile(r"(mlp\.experts\.linear_fc[12]\.weight)(\d+)")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")

# Parameters whose rows hold rotary dims, so their layout depends on the rope conventions.
_MAIN_ROPE_ROWS = ("self_attention.linear_q_up_proj.weight", "self_attention.linear_kv_down_proj.weight")
# MindSpeed's absorbed MLA (use_dsa_absorb): K and V up projections of their own, both HF kv_b_proj
_ABSORBED_K, _ABSORBED_V = "self_attention.linear_k_up_proj.weight", "self_attention.linear_v_up_proj.weight"
_INDEXER_ROWS = (
    "indexer.linear_wq_b.weight",
    "indexer.linear_wk.weight",
    "indexer.k_norm.weight",
    "indexer.k_norm.bias",
)


def _rope_order(rope_dim: int, interleaved: bool) -> torch.Tensor:
    """For each rotary position megatron computes with, the checkpoint position it reads."""
    if interleaved:
        return torch.arange(rope_dim)
    half = torch.arange(rope_dim // 2)
    return torch.stack([half, half + rope_dim // 2], dim=-1).flatten()  # pairs (i, i+d/2) -> (2i, 2i+1)


def _reorder_rows(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Reorder the rows of each block of ``len(order)`` rows (a head) of a weight, bias or norm."""
    blocks = tensor.reshape(-1, len(order), *tensor.shape[1:])
    return blocks[:, order.to(tensor.device)].reshape(tensor.shape)


class _EachNameOnce:
    """A reader that takes a name asked for twice as one request.

    Under MindSpeed's absorbed MLA, linear_k_up_proj and linear_v_up_proj both come from one HF tensor
    (kv_b_proj), so mbridge's loader asks for it twice per layer; mbridge's reader of a checkpoint without an index
    file counts the names and refuses the repeat ("Weights set() not found"), which stopped every absorbed-MLA load
    from a single-file checkpoint (the parity job's, a model saved by save_pretrained without shards)."""

    def load_some_hf_weight(self, hf_weight_names: list[str]) -> dict:
        return super().load_some_hf_weight(list(dict.fromkeys(hf_weight_names)))


class _Reader(_EachNameOnce, SavesWhatIsExported, ParallelSafeTensorIO):
    pass


class _BlockFP8Reader(_EachNameOnce, SavesWhatIsExported, BlockFP8SafeTensorIO):
    pass


class GLM5Bridge(DeepseekV3Bridge):
    """Bridge for ``GlmMoeDsaForCausalLM`` (GLM-5, GLM-5.1, GLM-5.2): DeepSeek-V3's tables plus DSA."""

    _ATTENTION_MAPPING: ClassVar[dict[str, list[str]]] = {
        **DeepseekV3Bridge._ATTENTION_MAPPING,
        # local spec: the q/kv norms are modules of their own, not fused into the up projections
        "self_attention.q_layernorm.weight": ["model.layers.{layer_number}.self_attn.q_a_layernorm.weight"],
        "self_attention.kv_layernorm.weight": ["model.layers.{layer_number}.self_attn.kv_a_layernorm.weight"],
        "self_attention.core_attention.indexer.linear_wq_b.weight": [
            "model.layers.{layer_number}.self_attn.indexer.wq_b.weight"
        ],
        "self_attention.core_attention.indexer.linear_wk.weight": [
            "model.layers.{layer_number}.self_attn.indexer.wk.weight"
        ],
        "self_attention.core_attention.indexer.k_norm.weight": [
            "model.layers.{layer_number}.self_attn.indexer.k_norm.weight"
        ],
        "self_attention.core_attention.indexer.k_norm.bias": [
            "model.layers.{layer_number}.self_attn.indexer.k_norm.bias"
        ],
        "self_attention.core_attention.indexer.linear_weights_proj.weight": [
            "model.layers.{layer_number}.self_attn.indexer.weights_proj.weight"
        ],
        _ABSORBED_K: ["model.layers.{layer_number}.self_attn.kv_b_proj.weight"],
        _ABSORBED_V: ["model.layers.{layer_number}.self_attn.kv_b_proj.weight"],
    }
    _LAYER_MAPPING: ClassVar[dict[str, list[str]]] = {**_ATTENTION_MAPPING, **DeepseekV3Bridge._MLP_MAPPING}

    # --- config ------------------------------------------------------------------------------
    def _build_config(self):
        return self._build_base_config(**glm5_config_fields(self.hf_config, _platform.detect()))

    def _get_gptmodel_args(self) -> dict:
        return dict(
            vocab_size=self.hf_config.vocab_size,
            max_sequence_length=self.hf_config.max_position_embeddings,
            position_embedding_type="rope",  # MLA builds its own rotary embeddings; GPTModel builds none
            rotary_base=rope_parameters(self.hf_config)[1],
        )

    # DeepSeek-V3's provider adds MTP layers for 61-layer models only; LLMBridge's pads the vocabulary.
    _model_provider = LLMBridge._model_provider

    def _get_transformer_layer_spec(self, vp_stage: int | None = None):
        """TransformerEngine spec with DSA attention (mbridge's default spec has no DSA).

        The local spec (verl_npu.engine.mbridge_local) replaces this method on the engine's bridge.
        """
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        self.has_vp_stage = True  # read by LLMBridge's provider
        block = get_transformer_block_with_experimental_attention_variant_spec(self.config, vp_stage=vp_stage)
        return self.transform_block_spec(block, vp_stage)

    def transform_block_spec(self, block_spec, vp_stage: int | None = None):
        """GLM-5's DSA layers as verl_npu.engine.index_share builds them: shared layers (GLM-5.2) without an
        indexer, reusing the most recent full layer's top-k, and the reference's indexer numerics."""
        from verl_npu.engine import index_share

        return index_share.apply_to_glm5_block(block_spec, self.hf_config, self.config, vp_stage)

    def _get_safetensor_io(self, weights_path: str):
        """mbridge's reader; for an FP8 checkpoint (``*_scale_inv`` tensors, with or without an index file)
        one that dequantises to bf16 on the CPU (see verl_npu.engine.bridges.fp8_safetensors). Either reads each
        requested name once (see :class:`_EachNameOnce`)."""
        path = self._get_actual_hf_path(weights_path)
        return _BlockFP8Reader(path) if is_fp8_block_scaled(path) else _Reader(path)

    # --- names -------------------------------------------------------------------------------
    def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep: bool = True) -> dict[str, str]:
        """mbridge's mapping, with local-spec SequentialMLP experts named like TE's grouped experts.

        mbridge's expert handling (EP id offsets, EP gathering on export, HF expert names) keys on
        TE's ``mlp.experts.linear_fc1.weight<id>``; the local spec names the same weight
        ``mlp.experts.local_experts.<id>.linear_fc1.weight``.
        """
        mapping = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=consider_ep)
        if getattr(self, "_defer_local_experts", False):  # load_weights loads them itself
            return {local: name for local, name in mapping.items() if not _LOCAL_EXPERT.search(local)}
        offset = 0
        if consider_ep and self.mpu.ep_size > 1:
            offset = self.config.num_moe_experts // self.mpu.ep_size * self.mpu.ep_rank
        for local, name in mapping.items():
            if match := _LOCAL_EXPERT.search(name):
                mapping[local] = f"{name[: match.start()]}.mlp.experts.{match[2]}.weight{int(match[1]) + offset}"
        return mapping

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        assert "_extra_state" not in mcore_weights_name, "extra_state should not be loaded"
        if mcore_weights_name in self._DIRECT_MAPPING:
            return [self._DIRECT_MAPPING[mcore_weights_name]]
        name = mcore_weights_name
        if match := _LOCAL_EXPERT.search(name):
            name = f"{name[: match.start()]}.mlp.experts.{match[2]}.weight{match[1]}"
        layer = _LAYER_PARAM.fullmatch(name)
        if layer is None:
            what = "MTP layers are not built by this bridge" if name.startswith("mtp.") else "unknown parameter"
            raise NotImplementedError(f"GLM-5 bridge: {what}: {mcore_weights_name}")
        layer_number, suffix = layer.groups()
        expert_id = None
        if expert := _TE_EXPERT.fullmatch(suffix):
            suffix, expert_id = expert.groups()
        templates = self._LAYER_MAPPING.get(suffix)
        if templates is None:
            raise NotImplementedError(f"GLM-5 bridge: unsupported parameter name: {mcore_weights_name}")
        return [t.format(layer_number=layer_number, expert_id=expert_id) for t in templates]

    # --- tensors -----------------------------------------------------------------------------
    def _row_order(self, mcore_weights_name: str) -> torch.Tensor | None:
        """How megatron's rows of this parameter read the checkpoint's, or None when they are the same."""
        cfg = self.hf_config
        rope = cfg.qk_rope_head_dim
        if mcore_weights_name.endswith(_INDEXER_ROWS):
            dim = cfg.index_head_dim
            # checkpoint: [rotary, rest] per head; megatron's indexer: [rest, rotary]
            rotary = _rope_order(rope, getattr(cfg, "indexer_rope_interleave", True))
            return torch.cat([torch.arange(rope, dim), rotary])
        if mcore_weights_name.endswith(_MAIN_ROPE_ROWS) and not getattr(cfg, "rope_interleave", True):
            before = cfg.qk_nope_head_dim if "linear_q_up_proj" in mcore_weights_name else cfg.kv_lora_rank
            return torch.cat([torch.arange(before), before + _rope_order(rope, interleaved=False)])
        return None

    def _absorbed_dims(self) -> tuple[int, int, int]:
        cfg = self.hf_config
        return cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim

    def _weight_to_mcore_format(self, mcore_weights_name: str, hf_weights: list[torch.Tensor]) -> torch.Tensor:
        if mcore_weights_name.endswith((_ABSORBED_K, _ABSORBED_V)):
            kv_b = super()._weight_to_mcore_format(mcore_weights_name, hf_weights)
            k_up, v_up = split_kv_b_proj(kv_b, *self._absorbed_dims())
            return k_up if mcore_weights_name.endswith(_ABSORBED_K) else v_up
        weight = super()._weight_to_mcore_format(mcore_weights_name, hf_weights)
        order = self._row_order(mcore_weights_name)
        return weight if order is None else _reorder_rows(weight, order)

    def _weight_to_hf_format(self, mcore_weights_name: str, mcore_weights: torch.Tensor):
        if mcore_weights_name.endswith((_ABSORBED_K, _ABSORBED_V)):
            return self._absorbed_to_hf(mcore_weights_name, mcore_weights)
        order = self._row_order(mcore_weights_name)
        if order is not None:
            mcore_weights = _reorder_rows(mcore_weights, torch.argsort(order))
        return super()._weight_to_hf_format(mcore_weights_name, mcore_weights)

    # --- MindSpeed's absorbed MLA: two megatron tensors, one HF tensor --------------------------
    def _absorbed_to_hf(self, mcore_weights_name: str, weight: torch.Tensor):
        """Hold one half of a layer's kv_b_proj until the other arrives (export yields each tensor once)."""
        pending = self.__dict__.setdefault("_absorbed_pending", {})
        layer = mcore_weights_name[: -len(_ABSORBED_K if mcore_weights_name.endswith(_ABSORBED_K) else _ABSORBED_V)]
        halves = pending.setdefault(layer, {})
        halves["k" if mcore_weights_name.endswith(_ABSORBED_K) else "v"] = weight
        if len(halves) < 2:
            return [], []
        del pending[layer]
        (hf_name,) = self._weight_name_mapping_mcore_to_hf(mcore_weights_name)
        return [hf_name], [merge_kv_b_proj(halves["k"], halves["v"], *self._absorbed_dims())]

    def export_weights(self, models):
        """mbridge's export (as verl_npu.engine.bridges.fast_export runs it: the pipeline metadata exchanged once,
        not per tensor); a layer whose absorbed K or V half never came is an error, not a silent gap (under verl's
        ``load_format: dummy`` a tensor never sent stays random in vLLM).

        Shared DSA layers have no indexer parameters, so nothing is exported for them, which is what vLLM
        under vllm-ascend expects when its own rule (top-k reuse from ``index_topk_freq`` /
        ``index_skip_topk_offset``) marks the same layers; a config where vLLM would build other indexers or
        MoE layers is logged once.
        """
        self._warn_if_the_rollout_builds_another_model()
        self.__dict__["_absorbed_pending"] = {}
        yield from fast_export.export_weights(self, models)
        pending = self.__dict__.pop("_absorbed_pending")
        if pending:
            missing = {layer: "K" if "k" not in halves else "V" for layer, halves in pending.items()}
            raise RuntimeError(f"GLM-5 bridge: kv_b_proj cannot be exported, the {missing} halves never came")

    def save_weights(self, models: list[torch.nn.Module], weights_path: str, memory_efficient: bool = False) -> None:
        """mbridge's saver (its reader lays the shards out: verl_npu.engine.bridges.hf_save). Loaded from an FP8
        release, the weights saved are the dequantised bf16 ones, so the saved config drops the release's
        ``quantization_config``: with it, a loader would read bf16 weights as FP8 codes without scales."""
        quantization = self.hf_config.__dict__.pop("quantization_config", None)
        try:
            super().save_weights(models, weights_path, memory_efficient)
        finally:
            if quantization is not None:
                self.hf_config.quantization_config = quantization

    # --- local-spec experts under expert / tensor parallelism --------------------------------
    def load_weights(self, models: list[torch.nn.Module], weights_path: str, memory_efficient: bool = False) -> None:
        """mbridge's loader, with the local spec's experts loaded the way mbridge loads TE's.

        mbridge tells experts (each EP rank reads its own, split over the expert-TP group) from other
        weights (TP rank 0 reads and scatters over the TP group) by TE's parameter names. It would
        scatter a local-spec expert from TP rank 0 to TP ranks that hold other experts whenever
        expert parallelism spans the TP ranks, so those experts are loaded here instead.

        Only the tensors of the parameters the model has are read: not the MTP layer's (said once per
        load) nor, for GLM-5.2, indexer tensors of shared layers (the published checkpoint has none).
        """
        self._defer_local_experts = True
        try:
            fast_load.load_weights(self, models, weights_path, memory_efficient)  # mbridge's, faster
        finally:
            self._defer_local_experts = False
        self._log_mtp_not_loaded()
        for model in models:
            self._load_local_experts(unwrap_model(model), memory_efficient)

    def _log_mtp_not_loaded(self) -> None:
        """Say once per load that the checkpoint's MTP layers (layer indices from num_hidden_layers on) were
        skipped. Found by name: verl zeroes ``num_nextn_predict_layers`` in the HF config unless MTP is on."""
        first = self.hf_config.num_hidden_layers
        mtp = sorted(
            {
                int(match[1])
                for name in self.safetensor_io.load_hf_weight_names()
                if (match := _CHECKPOINT_LAYER.match(name)) and int(match[1]) >= first
            }
        )
        if mtp:
            logger.warning(
                "GLM-5 bridge: the checkpoint's MTP layer(s) %s are neither built nor loaded: RL does not train "
                "them, and the rollout gets no MTP weights from the trainer",
                ", ".join(f"model.layers.{i}.*" for i in mtp),
            )

    def _warn_if_the_rollout_builds_another_model(self) -> None:
        """Log once when vLLM (with vllm-ascend) would build other DSA indexers or MoE layers than this model has:
        it reads other config fields than transformers and the bridge (contracts vllm-deepseek-v2-moe-layers,
        vllm-ascend-glm5-shared-layers-have-no-indexer). Its load then raises KeyError on a name it has no
        parameter for, or keeps dummy weights for a parameter it is never sent."""
        if self.__dict__.get("_rollout_layout_checked"):
            return
        self.__dict__["_rollout_layout_checked"] = True
        ours = {i for i, kind in enumerate(indexer_types(self.hf_config)) if kind == SHARED}
        rollout = set(layers_without_indexer(self.hf_config))
        if ours != rollout:
            logger.warning(
                "GLM-5 bridge: indexer_types marks layers %s shared (no indexer, nothing exported), but vllm-ascend "
                "builds no indexer on layers %s (it also needs index_topk_freq / index_skip_topk_offset or "
                "index_topk_pattern to say that they reuse top-k): the rollout's indexers differ from the trained "
                "model's, and an indexer never sent keeps vLLM's dummy weights",
                sorted(ours),
                sorted(rollout),
            )
        ours_moe = {i for i, moe in enumerate(moe_layer_freq(self.hf_config)) if moe}
        rollout_moe = vllm_moe_layers(self.hf_config)
        if rollout_moe is None:
            logger.warning(
                "GLM-5 bridge: the HF config has no first_k_dense_replace, which vLLM reads to tell dense from MoE "
                "layers (it does not read mlp_layer_types): the rollout cannot build this model; add "
                "first_k_dense_replace=%d to config.json",
                min(ours_moe, default=self.hf_config.num_hidden_layers),
            )
        elif ours_moe != set(rollout_moe):
            logger.warning(
                "GLM-5 bridge: mlp_layer_types makes layers %s MoE, but vLLM (first_k_dense_replace, moe_layer_freq) "
                "builds MoE layers %s: the rollout cannot load the exported weights",
                sorted(ours_moe),
                list(rollout_moe),
            )

    def _load_local_experts(self, model: torch.nn.Module, memory_efficient: bool) -> None:
        names = {
            local: name
            for local, name in self._weight_name_mapping_mcore_local_to_global(model).items()
            if _LOCAL_EXPERT.search(local)
        }
        hf_names = {local: self._weight_name_mapping_mcore_to_hf(name) for local, name in names.items()}
        reads_here = self.mpu.etp_rank == 0
        # as stored (the bridge's readers are fast_load's), each read on its own in the order taken (a prefetch's
        # reads claimed), FP8 dequantised on the device
        io = self.safetensor_io
        uses = collections.Counter(
            n for ns in (hf_names.values() if reads_here else ()) for n in fast_load.names_for_device(io, ns)
        )
        state = model.state_dict()
        device = next((p.device for p in model.parameters()), None)
        with TensorReads(io, list(uses), uses, device) as reads:
            for local, name in names.items():
                param, shards = state[local], None
                if reads_here:
                    tensors = fast_load.take_to_device(reads, io, hf_names[local], param.device)
                    weight = self._weight_to_mcore_format(name, tensors)
                    split = self._weight_split_across_tp(name, weight, param, self.mpu.etp_size)  # TE-style name
                    shards = [t.to(param.device, dtype=param.dtype).contiguous() for t in split]
                received = torch.empty_like(param)
                source = torch.distributed.get_global_rank(self.mpu.etp_group, 0)
                torch.distributed.scatter(received, shards, src=source, group=self.mpu.etp_group)
                param.copy_(received)

    def _weight_merge_across_tp(self, mcore_weights_name, mcore_weights, param):
        # Experts without expert TP are gathered over the TP group (their parameters carry
        # tensor_model_parallel) as identical copies; mbridge expects expert-TP-many shards.
        if "mlp.experts.linear_fc" in mcore_weights_name and self.mpu.etp_size == 1:
            return mcore_weights[0]
        return super()._weight_merge_across_tp(mcore_weights_name, mcore_weights, param)


_warned_upstream: set[type] = set()


def register() -> type:
    """Register :class:`GLM5Bridge` for ``glm_moe_dsa`` unless mbridge has a bridge of its own.

    Idempotent; returns the class registered for ``glm_moe_dsa``.
    """
    existing = _MODEL_REGISTRY.get(MODEL_TYPE)
    if existing is None:
        register_model(MODEL_TYPE)(GLM5Bridge)
    elif existing is not GLM5Bridge and existing not in _warned_upstream:
        _warned_upstream.add(existing)
        logger.warning(
            "verl-npu: mbridge registers %s for %s itself; verl-npu's GLM5Bridge is not used",
            f"{existing.__module__}.{existing.__qualname__}",
            MODEL_TYPE,
        )
    return _MODEL_REGISTRY[MODEL_TYPE]
