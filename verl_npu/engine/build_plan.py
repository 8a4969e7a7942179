"""The NPU Megatron engine's build plan: a pure function of verl's configs and the HF config.

It decides which features are on (fused RMSNorm, DSA, offload, precision-aware optimizer), the
TransformerConfig and DDP overrides that implement them, and the MindSpeed ``repatch`` arguments on
Ascend. Every invalid combination raises :class:`BuildPlanError` naming the keys, the rule and a
valid alternative. Preflight (launch checking) runs the same function.

The engine config's parallel sizes are read once, into the record preflight reads too
(:class:`verl_npu.parallelism.Parallelism`, :func:`engine_parallelism`): TP and CP for the fused DSA
and MindSpeed's arguments, and the pipeline layout (PP, VPP, the first/last stage's layer counts, and
``override_transformer_config.num_layers_per_virtual_pipeline_stage``): GLM-5.2's IndexShare layers
need it to know which model chunks start on a shared layer (:func:`model_chunks`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from typing import Any

from verl_npu.contracts.mindspeed import (
    DSA_ABSORB,
    DSA_CP_ALGORITHM,
    DSA_FUSED_OPERATORS,
    DSA_SWITCHES,
)
from verl_npu.dtypes import DtypeError, parse
from verl_npu.errors import UserError
from verl_npu.models import family as model_family
from verl_npu.models.family import FULL, SHARED
from verl_npu.ops import fused_dsa_rules
from verl_npu.parallelism import Parallelism
from verl_npu.pipeline_split import stage_layers

OTC = "override_transformer_config"
PLATFORMS = ("ascend", "cuda", "cpu")
DSA_FUSED_FLAGS = DSA_FUSED_OPERATORS
KV_ALLGATHER = DSA_CP_ALGORITHM
# Keys that MindSpeed reads from its arguments; megatron-core's TransformerConfig has no such field.
MINDSPEED_ONLY_KEYS = (
    "use_fused_rmsnorm",
    "use_fused_swiglu",
    "use_flash_attn",
    "context_parallel_algo",
    *DSA_SWITCHES,
)
# The optimizer state dtypes verl 0.9.1 takes: McoreOptimizerConfig.__post_init__ refuses anything but fp32
# and bf16 for all three (megatron-core itself would also store fp16/fp8 moments, but verl stops first).
PRECISIONS = {
    "main_grads_dtype": ("fp32", "bf16"),
    "exp_avg_dtype": ("fp32", "bf16"),
    "exp_avg_sq_dtype": ("fp32", "bf16"),
}


@dataclasses.dataclass(frozen=True)
class ModelChunk:
    """One model chunk of a pipeline layout: layers [first_layer, first_layer + num_layers) on one pipeline rank."""

    pp_rank: int
    vp_stage: int | None  # None: no virtual pipeline (one chunk per rank)
    first_layer: int
    num_layers: int

    @property
    def name(self) -> str:
        return f"stage {self.pp_rank}" + (f" chunk {self.vp_stage}" if self.vp_stage is not None else "")

    @property
    def layers(self) -> str:
        last = self.first_layer + self.num_layers - 1
        return f"layer {last}" if self.num_layers == 1 else f"layers {self.first_layer}-{last}"


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    pp: int
    vpp: int | None  # > 1: interleaved (virtual) pipeline
    first: int | None  # num_layers_in_first_pipeline_stage
    last: int | None  # num_layers_in_last_pipeline_stage

    @property
    def interleaved(self) -> bool:
        return self.vpp is not None and self.vpp > 1

    def describe(self) -> str:
        text = f"PP {self.pp}" + (f" x VPP {self.vpp}" if self.interleaved else "")
        ends = [f"{n} on the {w} stage" for n, w in ((self.first, "first"), (self.last, "last")) if n is not None]
        return text + (f" ({', '.join(ends)})" if ends else "")


def engine_parallelism(engine_config: Any) -> Parallelism:
    """The sizes verl's engine config asks megatron for, read once per plan. The plan is a function of the configs
    alone, so the record has no world size (its data-parallel sizes are the launch's: preflight's mesh check)."""
    otc = _get(engine_config, OTC) or {}
    tp = int(_get(engine_config, "tensor_model_parallel_size", 1) or 1)
    etp = _get(engine_config, "expert_tensor_parallel_size")
    vpp = _get(engine_config, "virtual_pipeline_model_parallel_size")
    return Parallelism(
        world=None,
        tp=tp,
        pp=int(_get(engine_config, "pipeline_model_parallel_size", 1) or 1),
        cp=int(_get(engine_config, "context_parallel_size", 1) or 1),
        ep=int(_get(engine_config, "expert_model_parallel_size", 1) or 1),
        etp=int(etp) if etp is not None else tp,  # megatron-core's default: TP
        sequence_parallel=bool(_get(engine_config, "sequence_parallel", False)),
        vpp=int(vpp) if vpp is not None else None,
        first_stage_layers=otc.get("num_layers_in_first_pipeline_stage"),
        last_stage_layers=otc.get("num_layers_in_last_pipeline_stage"),
    )


def pipeline_layout(engine_config: Any, num_layers: int | None = None) -> PipelineLayout:
    """The pipeline layout verl's engine config asks megatron for (see the module docstring)."""
    per_chunk = (_get(engine_config, OTC) or {}).get("num_layers_per_virtual_pipeline_stage")
    return layout_of(engine_parallelism(engine_config), per_chunk, num_layers)


def layout_of(sizes: Parallelism, per_chunk: int | None, num_layers: int | None = None) -> PipelineLayout:
    """``sizes``' pipeline, its VPP derived from ``num_layers_per_virtual_pipeline_stage`` (``per_chunk``) where only
    that is set, as Megatron-LM derives it: a (middle) stage's layers over the layers of one chunk."""
    pp, first, last, vpp = sizes.pp, sizes.first_stage_layers, sizes.last_stage_layers, sizes.vpp
    if vpp is None and per_chunk and num_layers and pp > 1:
        middle = pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        vpp = max((rest // middle if middle else first or 0) // int(per_chunk), 1)
    return PipelineLayout(pp, vpp, first, last)


def model_chunks(num_layers: int, layout: PipelineLayout) -> list[ModelChunk]:
    """Every model chunk in layer order, as megatron-core 0.18 places them (get_transformer_layer_offset).

    Raises PipelineSplitError (a ValueError) when megatron would not split the layers that way
    (verl_npu.pipeline_split, which preflight's mesh check reports too).
    """
    interleaved = layout.interleaved and layout.pp > 1  # megatron has no virtual pipeline on one stage
    vpp = (layout.vpp or 1) if interleaved else 1  # interleaved: vpp is set (> 1)
    per_stage = stage_layers(num_layers, layout.pp, layout.first, layout.last, layout.vpp)
    chunks, start = [], 0
    for vp_stage in range(vpp):
        for rank, layers in enumerate(per_stage):
            chunks.append(ModelChunk(rank, vp_stage if interleaved else None, start, layers // vpp))
            start += layers // vpp
    return chunks


def index_share_kinds(hf_config: Any) -> tuple[str, ...] | None:
    """Each layer's indexer ("full" / "shared") for a model of a registered DSA family (verl_npu.models), or for one
    listing GLM-5.2's ``indexer_types``, else None.

    Raises ValueError for a layout the engine cannot build (the family's ``indexer_kinds``).
    """
    kinds = model_family.layer_kinds(model_family.as_attributes(hf_config))
    if kinds is not None or _get(hf_config, "indexer_types") is None:
        return kinds
    from verl_npu.models.glm5.config import indexer_types

    return indexer_types(model_family.as_attributes(hf_config))


class BuildPlanError(UserError):
    """Invalid engine settings: every violated rule, each naming the keys, the rule and an alternative."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    platform: str
    features: tuple[str, ...]
    transformer_overrides: Mapping[str, Any]
    ddp_overrides: Mapping[str, Any]
    mindspeed_repatch: Mapping[str, Any] | None
    rmsnorm_impl: str | None
    notes: tuple[str, ...]
    # settings that are valid but do nothing on this platform (preflight reports them as warnings)
    warnings: tuple[str, ...] = ()
    # the optimizer's PRECISIONS keys, canonical (verl_npu.dtypes): what preflight's memory estimate counts
    optimizer_dtypes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def flash_attention(self) -> bool:
        """MindSpeed's flash attention (npu_fusion_attention): on Ascend unless use_flash_attn is off."""
        return bool(self.mindspeed_repatch and self.mindspeed_repatch.get("use_flash_attn"))

    @property
    def fused_dsa(self) -> bool:
        """MindSpeed's fused DSA operators replace DSAttention (else verl-npu's dsa-* patches run it)."""
        return "dsa_fused_operators" in self.features


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


class _Problems(list):
    def add(self, keys: str, rule: str, alternative: str) -> None:
        self.append(f"{keys}: {rule}. Instead: {alternative}")


def _normalization(otc: Mapping[str, Any], hf_config: Any) -> tuple[str, str]:
    if "normalization" in otc:
        return otc["normalization"], f"{OTC}.normalization"
    if _get(hf_config, "rms_norm_eps") is not None:
        return "RMSNorm", "the HF config (rms_norm_eps)"
    return "LayerNorm", "the HF config (no rms_norm_eps)"


def _is_dsa(otc: Mapping[str, Any], hf_config: Any) -> bool:
    return otc.get("experimental_attention_variant") == "dsa" or _get(hf_config, "index_topk") is not None


def build_plan(engine_config: Any, optimizer_config: Any, hf_config: Any, platform: str) -> BuildPlan:
    """Validate and translate verl's McoreEngineConfig / McoreOptimizerConfig for our engine.

    Every violated rule is collected and raised together in one :class:`BuildPlanError`.
    """
    if platform not in PLATFORMS:
        raise BuildPlanError([f"platform {platform!r}: must be ascend, cuda or cpu"])
    problems = _Problems()
    if not _get(engine_config, "vanilla_mbridge", False) and importlib.util.find_spec("megatron.bridge") is None:
        problems.add(
            "megatron.vanilla_mbridge=False",
            "verl 0.9.1 then builds models with Megatron-Bridge (megatron.bridge), which the verl-npu stack does "
            "not ship (it pins mbridge 0.15.1, patched for megatron-core 0.18)",
            "set actor_rollout_ref.actor.megatron.vanilla_mbridge=True (and ref/critic alike)",
        )
    otc = dict(_get(engine_config, OTC) or {})
    plan = _Draft(
        platform=platform,
        tf={k: v for k, v in otc.items() if k not in MINDSPEED_ONLY_KEYS},
        parallelism=engine_parallelism(engine_config),
    )
    _rmsnorm(plan, problems, otc, hf_config)
    _grouped_experts(plan, problems, otc)
    _dsa(plan, problems, otc, engine_config, hf_config)
    _index_share(plan, problems, otc, hf_config)
    _offload_and_optimizer(plan, problems, engine_config, optimizer_config)
    _router_replay(plan, problems, otc, engine_config)
    _mindspeed_moe(plan, problems, otc)
    _padding(plan, engine_config)
    if problems:
        raise BuildPlanError(problems)
    return BuildPlan(
        platform=platform,
        features=tuple(plan.features),
        transformer_overrides=plan.tf,
        ddp_overrides=plan.ddp,
        mindspeed_repatch=_mindspeed_repatch(plan, otc) if platform == "ascend" else None,
        rmsnorm_impl=plan.rmsnorm_impl,
        notes=tuple(plan.notes),
        warnings=tuple(plan.warnings),
        optimizer_dtypes=plan.optimizer_dtypes,
    )


@dataclasses.dataclass
class _Draft:
    platform: str
    tf: dict[str, Any]
    parallelism: Parallelism  # the engine config's sizes, read once (engine_parallelism)
    ddp: dict[str, Any] = dataclasses.field(default_factory=dict)
    features: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    rmsnorm_impl: str | None = None
    optimizer_dtypes: dict[str, str] = dataclasses.field(default_factory=dict)


def _mindspeed_repatch(plan: _Draft, otc: Mapping[str, Any]) -> dict[str, Any]:
    """What MindSpeed's ``repatch`` gets: the whole override_transformer_config, as upstream verl passes it.

    MindSpeed's features decide from these args whether to apply (its DSA feature reads
    experimental_attention_variant, for which it has no option) and its fused DSA path reads
    context_parallel_size without a default (verl_npu/contracts/mindspeed.py), so both always go.
    """
    repatch = {**plan.tf, **{k: otc[k] for k in MINDSPEED_ONLY_KEYS if k in otc}}
    repatch["context_parallel_size"] = plan.parallelism.cp
    repatch.setdefault("use_flash_attn", True)
    return repatch


def _grouped_experts(plan: _Draft, problems: _Problems, otc: Mapping[str, Any]) -> None:
    """MindSpeed core_r0.18.0 refuses moe_grouped_gemm when a TransformerConfig is built (contract
    mindspeed-refuses-moe-grouped-gemm): the GLM-5 bridge leaves it off on Ascend, and so must an override."""
    if plan.platform == "ascend" and otc.get("moe_grouped_gemm"):
        problems.add(
            f"{OTC}.moe_grouped_gemm=True",
            "MindSpeed core_r0.18.0 refuses grouped GEMM for the experts when the model config is built "
            "(NotImplementedError: not adapted to Megatron 0.18)",
            f"remove {OTC}.moe_grouped_gemm; on Ascend the experts run one GEMM each (SequentialMLP)",
        )


def _rmsnorm(plan: _Draft, problems: _Problems, otc: Mapping[str, Any], hf_config: Any) -> None:
    norm, source = _normalization(otc, hf_config)
    if plan.platform == "ascend":
        # MindSpeed core_r0.18.0 builds every RMSNorm as TransformerEngine-NPU's (contract
        # mindspeed-norm-ignores-use-fused-rmsnorm), so there is nothing to switch.
        if norm == "RMSNorm":
            plan.rmsnorm_impl = "TransformerEngine-NPU RMSNorm (MindSpeed's PTNorm)"
        if otc.get("use_fused_rmsnorm"):
            plan.warnings.append(
                "use_fused_rmsnorm changes nothing on Ascend: MindSpeed core_r0.18.0 builds every RMSNorm as "
                "TransformerEngine-NPU's RMSNorm whatever it says"
            )
        if otc.get("use_fused_swiglu"):
            plan.warnings.append("use_fused_swiglu has no effect: MindSpeed core_r0.18.0 reads it nowhere")
        return
    if otc.get("use_fused_swiglu"):
        plan.warnings.append(f"use_fused_swiglu is a MindSpeed switch; {plan.platform} ignores it")
    if not otc.get("use_fused_rmsnorm"):
        return
    if norm != "RMSNorm":
        problems.add(
            f"{OTC}.use_fused_rmsnorm=True",
            f"fused RMSNorm requires normalization='RMSNorm', but {source} gives {norm!r}",
            f"remove {OTC}.use_fused_rmsnorm for this model",
        )
        return
    plan.tf["normalization"] = "RMSNorm"
    plan.rmsnorm_impl = "verl_npu.engine.modules.RMSNorm"
    plan.features.append("fused_rmsnorm")
    plan.notes.append(f"fused RMSNorm -> {plan.rmsnorm_impl}")


def _dsa(plan: _Draft, problems: _Problems, otc: Mapping[str, Any], engine_config: Any, hf_config: Any) -> None:
    switches = [flag for flag in DSA_SWITCHES if otc.get(flag)]
    if not _is_dsa(otc, hf_config):
        if switches:
            problems.add(
                ", ".join(f"{OTC}.{f}=True" for f in switches),
                "MindSpeed's DSA switches need a DSA model",
                f"set {OTC}.experimental_attention_variant=dsa on an MLA model, or drop the switches",
            )
        return
    plan.features.append("dsa")
    _dsa_rules(problems, otc, engine_config, hf_config)
    plan.tf.update(
        experimental_attention_variant="dsa", multi_latent_attention=True, qk_layernorm=True, apply_rope_fusion=False
    )
    for ours, theirs in (
        ("dsa_indexer_n_heads", "index_n_heads"),
        ("dsa_indexer_head_dim", "index_head_dim"),
        ("dsa_indexer_topk", "index_topk"),
    ):
        if ours not in plan.tf and _get(hf_config, theirs) is not None:
            plan.tf[ours] = _get(hf_config, theirs)
    _dsa_context_parallel(plan, problems, otc)
    if not switches:
        return
    if len(switches) < len(DSA_SWITCHES):
        missing = [flag for flag in DSA_SWITCHES if flag not in switches]
        problems.add(
            ", ".join(f"{OTC}.{f}=True" for f in switches),
            f"MindSpeed's four DSA switches ({', '.join(DSA_SWITCHES)}) go on or off together: the fused operators "
            f"take absorbed MLA only (one latent key head, {DSA_ABSORB}), and the indexer operator's backward is the "
            "KL-loss operator's",
            "also set " + ", ".join(f"{OTC}.{f}=True" for f in missing) + " (or none of them)",
        )
        return
    if plan.platform != "ascend":
        plan.warnings.append(
            f"{', '.join(DSA_SWITCHES)} are MindSpeed switches for Ascend's fused operators; {plan.platform} builds "
            "megatron's unabsorbed MLA and runs verl-npu's portable/Triton DSA path"
        )
        return
    before = len(problems)
    _fused_dsa_shapes(problems, plan.tf, plan.parallelism.tp, hf_config)
    if len(problems) > before:
        return
    plan.features += ["dsa_absorbed_mla", "dsa_fused_operators"]
    plan.notes += [
        f"{DSA_ABSORB}: MindSpeed's MLASelfAttentionAbsorb replaces linear_kv_up_proj with linear_k_up_proj + "
        "linear_v_up_proj (the GLM-5 bridge maps both to HF kv_b_proj)",
        "fused DSA: MindSpeed replaces DSAttention.forward and DSAIndexer.forward_with_scores with "
        "npu_lightning_indexer + npu_sparse_flash_attention; verl-npu's dsa-* runtime patches are not in effect "
        "on that path",
        "fused DSA: npu_sparse_lightning_indexer_grad_kl_loss runs on every training forward, also at "
        "dsa_indexer_loss_coeff=0 (MindSpeed multiplies its loss by the coefficient afterwards)",
    ]


def _dsa_rules(problems: _Problems, otc: Mapping[str, Any], engine_config: Any, hf_config: Any) -> None:
    """What megatron-core 0.18's and MindSpeed's DSA refuse, whichever kernel runs it."""
    if _get(hf_config, "kv_lora_rank") is None and not otc.get("multi_latent_attention"):
        problems.add(
            f"{OTC}.experimental_attention_variant='dsa'",
            "DSA (DeepSeek sparse attention) requires multi-latent attention, and this model has no kv_lora_rank",
            "use an MLA model (DeepSeek-V3.2, GLM-5) or drop experimental_attention_variant",
        )
    if otc.get("qk_layernorm") is False:
        problems.add(
            f"{OTC}.qk_layernorm=False",
            "DSA requires qk_layernorm",
            f"remove {OTC}.qk_layernorm (the engine enables it)",
        )
    if otc.get("apply_rope_fusion"):
        problems.add(
            f"{OTC}.apply_rope_fusion=True", "megatron-core's DSA asserts apply_rope_fusion=False", "remove it"
        )
    if otc.get("eod_mask_loss") or _get(engine_config, "eod_mask_loss", False):
        problems.add("eod_mask_loss=True", "MindSpeed's DSA refuses EOD mask loss", "set eod_mask_loss=False")
    if _get(engine_config, "use_remove_padding", False):
        problems.add(
            "use_remove_padding=True",
            "DSA does not support packed (THD) input in megatron-core 0.18",
            "set actor_rollout_ref.actor.megatron.use_remove_padding=False (and ref/critic alike)",
        )
    modules = otc.get("recompute_modules")
    if otc.get("recompute_granularity") == "selective" and (modules is None or "core_attn" in modules):
        shown = (
            f"recompute_modules={list(modules)}"
            if modules is not None
            else "recompute_modules unset (megatron's default ['core_attn'])"
        )
        problems.add(
            f"{OTC}.recompute_granularity=selective with {shown}",
            "megatron-core 0.18's selective recompute of core_attn checkpoints the core attention without passing "
            "DSA its x and qr inputs (the indexer's), so a DSA model cannot recompute it",
            f"set {OTC}.recompute_granularity=full (with recompute_method / recompute_num_layers), or keep selective "
            f'recompute with recompute_modules that leave out core_attn, e.g. ["mla_up_proj", "mlp"]',
        )


def _padding(plan: _Draft, engine_config: Any) -> None:
    """verl 0.9.1 pads every padded (BSHD) micro-batch to its mini-batch's longest sequence by default
    (pad_bshd_to_minibatch_max, for one cuDNN plan per shape); with dynamic batching a short sequence alone in its
    micro-batch then costs the longest one's step (bench/results/padded_layout_h200.json: 20x at 4k of 32k)."""
    if _get(engine_config, "use_remove_padding", False) or not _get(engine_config, "pad_bshd_to_minibatch_max", True):
        return
    plan.warnings.append(
        "pad_bshd_to_minibatch_max=True (verl's default) pads every micro-batch to the mini-batch's longest sequence: "
        "a 4k sequence in a 32k mini-batch then takes the 32k step (20x on nvidia-h200, "
        "bench/results/padded_layout_h200.json); set megatron.pad_bshd_to_minibatch_max=False to pad each "
        "micro-batch to its own longest"
    )


ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")
ROUTER_REPLAY_KEY = "actor_rollout_ref.actor.megatron.router_replay.mode"


def _router_replay(plan: _Draft, problems: _Problems, otc: Mapping[str, Any], engine_config: Any) -> None:
    """verl's MoE routing replay: exact where its routes land on the rows the routers see (docs/router_replay.md).

    Packed (THD) input is verl's own layout; padded (BSHD) input, the only one DSA takes, is laid out by the
    router-replay-padded patch. Refused: what replays other experts than recorded, whatever the layout (and,
    on Ascend, MindSpeed's tp-extend-ep routing, which _mindspeed_moe refuses outright)."""
    mode = _get(_get(engine_config, "router_replay"), "mode", "disabled")
    if mode not in ROUTER_REPLAY_MODES[1:]:
        return  # off, or a mode verl's EngineRouterReplayConfig refuses itself (preflight names it once)
    if not _get(engine_config, "use_remove_padding", False):
        plan.features.append("router_replay_padded")
        plan.notes.append(f"router replay {mode} on the padded layout: routes laid on [seq, batch] rows")
    capacity = otc.get("moe_expert_capacity_factor")
    if capacity is not None:
        problems.add(
            f"{ROUTER_REPLAY_KEY}={mode} with {OTC}.moe_expert_capacity_factor={capacity}",
            "megatron drops the tokens over an expert's capacity after the (replayed) choice, per micro-batch, so "
            "under another split or batch a replayed token loses some of its recorded experts",
            f"remove {OTC}.moe_expert_capacity_factor (dropless MoE), or set router_replay.mode=disabled",
        )


def _mindspeed_moe(plan: _Draft, problems: _Problems, otc: Mapping[str, Any]) -> None:
    """MindSpeed core_r0.18.0's MoE features that cannot run over megatron-core 0.18 (executed with MindSpeed's
    source on the CPU: tests_npu/patching/test_ascend_sim_router_replay.py, docs/router_replay.md)."""
    if plan.platform != "ascend":
        return
    if otc.get("moe_tp_extend_ep"):
        problems.add(
            f"{OTC}.moe_tp_extend_ep=True",
            "MindSpeed's tp-extend-ep feature imports megatron's legacy all-to-all dispatcher, which megatron-core "
            "0.18 removed: repatch raises ModuleNotFoundError (mindspeed/core/transformer/moe/moe_feature); it would "
            "also replace TopKRouter.routing, where verl's routing replay hooks in",
            f"remove {OTC}.moe_tp_extend_ep",
        )
    fused = [key for key in ("moe_permute_fusion", "use_fused_moe_token_permute_and_unpermute") if otc.get(key)]
    if fused and otc.get("moe_token_dispatcher_type", "alltoall") == "alltoall":
        problems.add(
            f"{OTC}.{fused[0]}=True with the all-to-all dispatcher",
            "MindSpeed core_r0.18.0 then wraps MoEAlltoAllTokenDispatcher.__init__ with a signature that lacks "
            "megatron-core 0.18's pg_collection, so no MoE layer builds (TypeError)",
            f"remove {OTC}.{fused[0]}",
        )


def _index_share(plan: _Draft, problems: _Problems, otc: Mapping[str, Any], hf_config: Any) -> None:
    """GLM-5.2's shared DSA layers: a model whose first layer is shared, and pipelines the top-k carry cannot serve.

    A shared layer reuses the top-k of the most recent full layer (verl_npu.engine.index_share); a pipeline
    stage that starts on a shared layer receives it from the previous stage, one model chunk per stage.
    """
    try:
        kinds = index_share_kinds(hf_config)
    except ValueError as exc:
        problems.add(
            "indexer_types (model config)",
            str(exc).removeprefix("GLM-5 bridge: "),
            "a model config whose indexer_types lists 'full' or 'shared' for every layer and marks layer 0 'full' "
            "(GLM-5.2's published config.json does)",
        )
        return
    if kinds is None or SHARED not in kinds:
        return
    plan.features.append("dsa_index_share")
    per_chunk = otc.get("num_layers_per_virtual_pipeline_stage")
    layout = layout_of(plan.parallelism, per_chunk, len(kinds))
    try:
        chunks = model_chunks(len(kinds), layout)
    except ValueError:
        return  # an uneven split is the mesh's finding (preflight), megatron's assertion (engine)
    from verl_npu.engine.index_share import stage_plans

    plans = stage_plans(kinds, [c.num_layers for c in chunks])  # chunks are in layer order
    receiving = [c for c, p in zip(chunks, plans, strict=True) if p.receives]
    full = kinds.count(FULL)
    if layout.interleaved and receiving:
        flat = dataclasses.replace(layout, vpp=None)
        alternative = (
            f"the same {flat.describe()} without a virtual pipeline (drop virtual_pipeline_model_parallel_size "
            "and num_layers_per_virtual_pipeline_stage)"
        )
        try:
            stages = model_chunks(len(kinds), flat)
        except ValueError:
            stages = []
        if stages:
            flat_plans = stage_plans(kinds, [c.num_layers for c in stages])
            carried = [str(c.pp_rank) for c, p in zip(stages, flat_plans, strict=True) if p.receives]
            alternative += f": its stages start at layers {', '.join(str(c.first_layer) for c in stages)}"
            if carried:
                alternative += f", and stage{'s' * (len(carried) > 1)} {', '.join(carried)} receive"
                alternative += "s" * (len(carried) == 1) + " the top-k from the stage before"
        where = "; ".join(f"{c.name} ({c.layers}) starts on shared layer {c.first_layer}" for c in receiving)
        setting = (
            f"virtual_pipeline_model_parallel_size={layout.vpp}"
            if plan.parallelism.vpp is not None
            else f"{OTC}.num_layers_per_virtual_pipeline_stage={per_chunk}"
        )
        problems.add(
            f"{setting} ({layout.describe()}) on a model with {len(kinds) - full} shared DSA layers (indexer_types)",
            f"{where}: a model chunk that starts on a shared layer needs the top-k of the chunk before it, and "
            "verl-npu carries the top-k only between consecutive pipeline stages of a non-interleaved pipeline "
            "(one model chunk per stage)",
            alternative,
        )
        return
    plan.notes.append(
        f"IndexShare: {full} full / {len(kinds) - full} shared DSA indexers (shared layers reuse the most recent full "
        "layer's top-k and have no indexer parameters)"
        + (
            f"; stages {', '.join(str(c.pp_rank) for c in receiving)} start on a shared layer and receive the "
            "previous stage's top-k after its activations (int32 [b, s/CP, k] per micro-batch, pipeline group)"
            if receiving
            else ""
        )
    )


def _dsa_context_parallel(plan: _Draft, problems: _Problems, otc: Mapping[str, Any]) -> None:
    cp = plan.parallelism.cp
    if cp <= 1:
        return
    if plan.platform != "ascend":
        problems.add(
            f"context_parallel_size={cp} with DSA",
            "megatron-core 0.18's DSA asserts context_parallel_size=1 (only MindSpeed on Ascend shards it)",
            "use context_parallel_size=1 off Ascend",
        )
    elif otc.get("context_parallel_algo") != KV_ALLGATHER:
        problems.add(
            f"context_parallel_size={cp} with DSA, {OTC}.context_parallel_algo={otc.get('context_parallel_algo')!r}",
            "DSA with context parallelism needs the kv-allgather CP algorithm (MindSpeed then lets megatron's "
            "TransformerConfig accept DSA with CP > 1)",
            f"set {OTC}.context_parallel_algo={KV_ALLGATHER}",
        )
    else:
        plan.features.append("dsa_cp_kvallgather")
        plan.notes.append(
            f"context parallelism {cp} with DSA: MindSpeed's kv-allgather CP gathers the keys of every CP rank "
            "and bypasses megatron-core 0.18's CP == 1 assertion for DSA"
        )


def _fused_dsa_shapes(problems: _Problems, tf: Mapping[str, Any], tp: int, hf_config: Any) -> None:
    """The fused operators' input rules, checked on the model before a node finds them."""
    switches = f"{OTC}.{DSA_ABSORB} and the fused DSA operators"
    drop = f"drop the four DSA switches ({', '.join(DSA_SWITCHES)}); verl-npu's portable DSA path takes any shape"
    latent, rope = _get(hf_config, "kv_lora_rank"), _get(hf_config, "qk_rope_head_dim")
    if (latent, rope) != (fused_dsa_rules.LATENT_DIM, fused_dsa_rules.ROPE_DIM):
        problems.add(
            f"{switches} with kv_lora_rank={latent}, qk_rope_head_dim={rope}",
            f"npu_sparse_flash_attention takes one latent key head of {fused_dsa_rules.LATENT_DIM} channels plus "
            f"{fused_dsa_rules.ROPE_DIM} rope channels",
            drop,
        )
    heads = _get(hf_config, "num_attention_heads")
    if heads not in fused_dsa_rules.KL_QUERY_HEADS:
        problems.add(
            f"{switches} with num_attention_heads={heads}",
            f"the fused KL-loss operator takes the TP-gathered attention heads in {fused_dsa_rules.KL_QUERY_HEADS} "
            "(MindSpeed checks the same when it builds the TransformerConfig)",
            drop,
        )
    elif heads % tp or heads // tp not in fused_dsa_rules.SFA_QUERY_HEADS:
        problems.add(
            f"{switches} with num_attention_heads={heads}, tensor_model_parallel_size={tp}",
            f"npu_sparse_flash_attention takes {fused_dsa_rules.SFA_QUERY_HEADS} query heads per device",
            "use a tensor parallel size that divides the heads into a power of two",
        )
    index_heads, index_dim = tf.get("dsa_indexer_n_heads"), tf.get("dsa_indexer_head_dim")
    if index_heads not in fused_dsa_rules.KL_INDEXER_HEADS:
        problems.add(
            f"{switches} with dsa_indexer_n_heads={index_heads}",
            f"the fused indexer and KL-loss operators take {fused_dsa_rules.KL_INDEXER_HEADS} indexer heads",
            drop,
        )
    if index_dim != fused_dsa_rules.INDEXER_HEAD_DIM:
        problems.add(
            f"{switches} with dsa_indexer_head_dim={index_dim}",
            f"npu_lightning_indexer takes indexer head dim {fused_dsa_rules.INDEXER_HEAD_DIM}",
            drop,
        )
    topk = tf.get("dsa_indexer_topk")
    if topk not in fused_dsa_rules.FUSED_TOPK:
        problems.add(
            f"{switches} with dsa_indexer_topk={topk}",
            f"the fused KL-loss operator takes a top-k that is a multiple of 1024 up to 8192 (npu_lightning_indexer "
            f"takes those too): {', '.join(map(str, fused_dsa_rules.FUSED_TOPK))}",
            drop,
        )


def _offload_and_optimizer(plan: _Draft, problems: _Problems, engine_config: Any, optimizer_config: Any) -> None:
    if _get(engine_config, "param_offload", False):
        plan.features.append("param_offload")
    if _get(engine_config, "optimizer_offload", False):
        plan.features.append("optimizer_offload")
    user_ddp = dict(_get(engine_config, "override_ddp_config") or {})
    precision_aware = bool(_get(optimizer_config, "use_precision_aware_optimizer", False))
    dtypes = plan.optimizer_dtypes = _optimizer_dtypes(problems, optimizer_config)
    if not precision_aware:
        lowered = [f"optim.{k}={v}" for k, v in dtypes.items() if v != "fp32"]
        if lowered:
            problems.add(
                ", ".join(lowered),
                "lower-precision optimizer dtypes only take effect with the precision-aware optimizer",
                "set optim.use_precision_aware_optimizer=True, or keep them at fp32",
            )
        return
    if not _get(engine_config, "use_distributed_optimizer", True):
        problems.add(
            "optim.use_precision_aware_optimizer=True with megatron.use_distributed_optimizer=False",
            "megatron's precision-aware optimizer requires the distributed optimizer",
            "set megatron.use_distributed_optimizer=True",
        )
    if plan.platform != "ascend" and importlib.util.find_spec("transformer_engine") is None:
        problems.add(
            "optim.use_precision_aware_optimizer=True",
            f"off Ascend it needs TransformerEngine's FusedAdam, not installed on this {plan.platform} machine",
            "install transformer_engine, or set optim.use_precision_aware_optimizer=False",
        )
    plan.features.append("precision_aware_optimizer")
    if "grad_reduce_in_fp32" not in user_ddp:
        plan.ddp["grad_reduce_in_fp32"] = dtypes["main_grads_dtype"] == "fp32"
        plan.notes.append(f"DDP gradient buckets follow main_grads_dtype={dtypes['main_grads_dtype']}")


def _optimizer_dtypes(problems: _Problems, optimizer_config: Any) -> dict[str, str]:
    """Each PRECISIONS key's dtype, canonical (verl_npu.dtypes; unset: fp32); a spelling it must not take is a
    problem."""
    dtypes = {}
    for key, allowed in PRECISIONS.items():
        value = _get(optimizer_config, key)
        try:
            dtypes[key] = parse(value, "fp32")
        except DtypeError:
            dtypes[key] = str(value)
        if dtypes[key] not in allowed:
            problems.add(
                f"optim.{key}={dtypes[key]}",
                f"{key} must be one of {', '.join(allowed)} (verl 0.9.1's McoreOptimizerConfig refuses the rest)",
                f"set optim.{key} to one of {', '.join(allowed)}",
            )
    return dtypes
