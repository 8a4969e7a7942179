"""The router replay scenario of the ascend_sim tier (tests_npu/patching/test_ascend_sim_router_replay.py), run in a
fresh process by support/ascend_sim_run.py.

Engines in one process, each as verl-npu's engine starts: build plan -> MindSpeed's ``repatch`` with the plan's
arguments (a MoE model on the alltoall dispatcher, MindSpeed's fused MoE permutation added: see ENGINE) -> for the
engine with router replay, verl 0.9.1's ``apply_router_replay_patch``, then its routers. What runs for real:
MindSpeed's features list, patch manager and ``repatch``; verl's replay patch and registry; megatron-core's
``TopKRouter`` (through verl's replay routing) and ``MoEAlltoAllTokenDispatcher.preprocess`` (under MindSpeed's
wrapper and verl's). What stands in: the stand-ins of support/ascend_sim.py; the dispatcher's device-to-host stream
(a CPU has none; ``preprocess`` never uses it); one MindSpeed feature that manages ``TopKRouter.routing``
(MindSpeed's own, ``moe_tp_extend_ep``, cannot import over megatron-core 0.18: the scenario records that too).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

from support import ascend_sim

# verl's engine settings for a MoE actor on Ascend: the alltoall dispatcher. MindSpeed manages the dispatcher's
# preprocess only with its fused MoE permutation, which the build plan refuses at this MindSpeed commit (no MoE layer
# builds under it, recorded below as "moe_layer_refusal"): the scenario adds it to the repatch arguments, the state
# a MindSpeed whose fused permutation builds would be in.
ENGINE = {"vanilla_mbridge": True, "override_transformer_config": {"moe_token_dispatcher_type": "alltoall"}}
FUSED_PERMUTE = {"moe_permute_fusion": True}
OTC = "override_transformer_config"
HF_CONFIG = {"model_type": "qwen3_moe", "rms_norm_eps": 1e-6}
EXPERTS, TOPK, LAYERS = 4, 2, 2
# The routes replayed for four tokens: token 0's two routes name expert 1 twice, which collapses in routing_map
REPLAYED = [[1, 1], [0, 2], [3, 0], [2, 3]]
VERL_REPLAY_MODULE = "verl.utils.megatron.router_replay_patch"
DISPATCHER = "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher"
ROUTING = "megatron.core.transformer.moe.router.TopKRouter.routing"


def _refusal(step) -> str | None:
    """What ``step()`` raised, as ``Type: message`` (None when it ran)."""
    try:
        step()
    except Exception as exc:  # the observation
        return f"{type(exc).__name__}: {exc}"
    return None


def _inner(function):
    """What a wrapper calls: functools.wraps says it; verl's replay wrappers keep it in a closure variable named
    original_* instead."""
    wrapped = getattr(function, "__wrapped__", None)
    if wrapped is not None:
        return wrapped
    code = getattr(function, "__code__", None)
    for name, cell in zip(code.co_freevars if code else (), getattr(function, "__closure__", None) or (), strict=True):
        if name.startswith("original_") and callable(cell.cell_contents):
            return cell.cell_contents
    return None


def _chain(function) -> list[str]:
    """What an attribute runs, outermost first: each function's file and qualified name (its code's: a
    functools.wraps wrapper carries the name of what it wraps)."""
    chain = []
    while function is not None and len(chain) < 64:
        code = getattr(function, "__code__", None)
        chain.append(f"{Path(code.co_filename).name}:{code.co_qualname}" if code else repr(function))
        function = _inner(function)
    return chain


def _wraps_mindspeeds_current_preprocess() -> bool:
    """The dispatcher's preprocess calls the function MindSpeed's patch manager installed last (not an older one)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from mindspeed.patch_utils import MindSpeedPatchesManager

    return _inner(MoEAlltoAllTokenDispatcher.preprocess) is (
        MindSpeedPatchesManager.patches_info[f"{DISPATCHER}.preprocess"].final_patch_func
    )


def _targets() -> dict[str, list[str]]:
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    return {
        "MoEAlltoAllTokenDispatcher.preprocess": _chain(MoEAlltoAllTokenDispatcher.preprocess),
        "TopKRouter.routing": _chain(TopKRouter.routing),
        "TopKRouter.__init__": _chain(TopKRouter.__init__),
        "TransformerConfig.__init__": _chain(TransformerConfig.__init__),
    }


def _flags() -> dict[str, bool]:
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    owners = {"_preprocess_patched": MoEAlltoAllTokenDispatcher, "_verl_router_patched": TransformerConfig,
              "_router_replay_patched": TopKRouter}  # fmt: skip
    return {flag: bool(getattr(owner, flag, False)) for flag, owner in owners.items()}


def _config():
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=8, num_attention_heads=2, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_token_dispatcher_type="alltoall", use_cpu_initialization=True, params_dtype=torch.float32,
        add_bias_linear=False,
        # megatron refuses its fused permutation without TransformerEngine (absent here; TE-NPU on a node): the
        # model's config leaves it off, MindSpeed's repatch arguments carry it (that is what makes MindSpeed manage
        # the dispatcher's preprocess)
        moe_permute_fusion=False,
    )  # fmt: skip
    config.moe_enable_routing_replay = True  # what verl's engine sets on a megatron-core 0.18 config
    return config


def _moe_layer_refusal(config, groups) -> str | None:
    """megatron-core's MoELayer for the config, built as a model builds it; the error it raises, if any."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False).submodules.mlp
    try:
        spec(config=config, pg_collection=groups)
    except Exception as exc:  # the observation
        return f"{type(exc).__name__}: {exc}"
    return None


def _dispatcher(config, groups):
    """A real MoEAlltoAllTokenDispatcher, made by megatron's own __init__ (MindSpeed's wrapper of it takes no
    pg_collection: see _moe_layer_refusal); the class's methods are the patched ones."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from mindspeed.patch_utils import MindSpeedPatchesManager

    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = types.SimpleNamespace(stands_in_for="a device-to-host stream")
    megatron_init = MindSpeedPatchesManager.patches_info[f"{DISPATCHER}.__init__"].orig_func
    dispatcher = object.__new__(MoEAlltoAllTokenDispatcher)
    megatron_init(dispatcher, EXPERTS, list(range(EXPERTS)), config=config, pg_collection=groups)
    return dispatcher


def _replay(routers, dispatcher) -> dict:
    """verl's replay of REPLAYED on every router (the action set through verl's registry, as its engine sets it),
    routed by TopKRouter.routing, then the dispatcher's preprocess of the first router's routing_map."""
    import torch
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction

    logits = torch.randn(len(REPLAYED), 1, EXPERTS, generator=torch.Generator().manual_seed(0))
    for router in routers:
        router.router_replay.set_target_indices(torch.tensor(REPLAYED))
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        maps = [router.routing(logits)[1] for router in routers]
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
    dispatcher.preprocess(maps[0])
    return {
        "routed": [int(m.sum()) for m in maps],
        "num_out_tokens": int(dispatcher.num_out_tokens),
        "tokens_times_topk": len(REPLAYED) * TOPK,
    }


def _engine_state(routers, dispatcher, registry) -> dict:
    from verl.utils.megatron.router_replay_patch import RouterReplay

    return {
        "targets": _targets(),
        "wraps_mindspeeds_current_preprocess": _wraps_mindspeeds_current_preprocess(),
        "flags": _flags(),
        "replay": _replay(routers, dispatcher),
        "registry_is_the_same_list": RouterReplay.router_instances is registry,
        "registry_holds_the_first_engines_routers_in_order": [id(r) for r in RouterReplay.router_instances]
        == [id(router.router_replay) for router in routers],
    }


def _routing_stand_in(routing):
    """A MindSpeed feature managing TopKRouter.routing, as MoETpExtendEpFeature registers its routing (which cannot
    import here), with megatron's own routing as the function it installs."""
    from mindspeed.features_manager.feature import MindSpeedFeature

    class ManagesTopKRouting(MindSpeedFeature):
        def __init__(self):
            super().__init__("verl-npu-routing-stand-in", optimization_level=0)  # level 0: always applies

        def register_patches(self, patch_manager, args):
            patch_manager.register_patch(ROUTING, routing)

    return ManagesTopKRouting()


def router_replay(inputs: dict) -> dict:
    ascend_sim.activate(Path(inputs["mindspeed"]))
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager

    from verl_npu import runtime_patches
    from verl_npu.engine import build
    from verl_npu.engine.build_plan import build_plan
    from verl_npu.patching import PatchEngine
    from verl_npu.runtime_patches import mindspeed_router_replay
    from verl_npu.testing import cpu_megatron

    layer = PatchEngine("ascend")  # the layer's order on a node: MindSpeed imported, then verl-npu's patches
    for patch in runtime_patches.ALL:
        layer.schedule(patch)
    patch = mindspeed_router_replay.PATCH
    cpu_megatron.activate()
    cpu_megatron.init_model_parallel()
    groups = ProcessGroupCollection.use_mpu_process_groups()
    plan = build_plan(ENGINE, {}, HF_CONFIG, "ascend")
    plan = dataclasses.replace(plan, mindspeed_repatch={**plan.mindspeed_repatch, **FUSED_PERMUTE})
    out: dict = {"repatch": dict(plan.mindspeed_repatch), "status": layer.record(patch.id).status}
    refused = {
        "moe_permute_fusion": {**ENGINE["override_transformer_config"], **FUSED_PERMUTE},
        "moe_tp_extend_ep": {**ENGINE["override_transformer_config"], "moe_tp_extend_ep": True},
    }
    out["plan_refuses"] = {
        key: _refusal(lambda otc=otc: build_plan({**ENGINE, OTC: otc}, {}, HF_CONFIG, "ascend"))
        for key, otc in refused.items()
    }

    # engines without router replay: before and after verl's replay module is imported (verl's Megatron engine
    # imports it whether replay is on or not), each repatch with verl-npu's patch and without it
    without_replay = {}
    for stage in ("before_verls_module", "verls_module_imported"):
        if stage == "verls_module_imported":
            __import__(VERL_REPLAY_MODULE)
        build.enter_mindspeed(plan)
        with_patch = _targets()
        layer.revert(patch)
        build.enter_mindspeed(plan)
        without_patch = _targets()
        layer.apply(patch)
        without_replay[stage] = {"with_patch": with_patch, "without_patch": without_patch, "flags": _flags(),
                                 "restored": list(mindspeed_router_replay.restore_verl_router_replay())}  # fmt: skip
    out["without_replay"] = without_replay

    config = _config()
    out["moe_layer_refusal"] = _moe_layer_refusal(config, groups)
    megatron_routing = TopKRouter.routing

    # the actor: repatch (above), then verl's replay patch as MegatronEngine.__init__ applies it, then its model
    from verl.utils.megatron.router_replay_patch import RouterReplay, apply_router_replay_patch

    build.enter_mindspeed(plan)
    apply_router_replay_patch()
    routers = [TopKRouter(config=config, pg_collection=groups) for _ in range(LAYERS)]
    registry = RouterReplay.router_instances
    dispatcher = _dispatcher(config, groups)
    out["actor"] = _engine_state(routers, dispatcher, registry)

    # a second engine (the reference model) without verl-npu's patch, then two more with it
    layer.revert(patch)
    build.enter_mindspeed(plan)
    out["second_engine_without_patch"] = _engine_state(routers, dispatcher, registry)
    layer.apply(patch)
    for name in ("third_engine", "fourth_engine"):
        build.enter_mindspeed(plan)
        out[name] = _engine_state(routers, dispatcher, registry)
    preprocess = MoEAlltoAllTokenDispatcher.preprocess
    out["restored_again"] = list(mindspeed_router_replay.restore_verl_router_replay())
    out["preprocess_unchanged_by_a_second_call"] = MoEAlltoAllTokenDispatcher.preprocess is preprocess
    out["displaced"] = layer.displaced()

    # a MindSpeed feature that manages TopKRouter.routing
    MindSpeedFeaturesManager.FEATURES_LIST.append(_routing_stand_in(megatron_routing))
    layer.revert(patch)
    build.enter_mindspeed(plan)
    out["routing_managed_without_patch"] = _targets()["TopKRouter.routing"]
    layer.apply(patch)
    build.enter_mindspeed(plan)
    out["routing_managed"] = _engine_state(routers, dispatcher, registry)
    MindSpeedFeaturesManager.FEATURES_LIST.pop()

    # MindSpeed's own routing feature, moe_tp_extend_ep, as a user's override would pass it (last: it fails mid-way)
    # (the build plan refuses it: the repatch arguments get it directly)
    tp_extend_ep = dataclasses.replace(plan, mindspeed_repatch={**plan.mindspeed_repatch, "moe_tp_extend_ep": True})
    out["tp_extend_ep"] = _refusal(lambda: build.enter_mindspeed(tp_extend_ep))
    out["verl_replay_module_loaded"] = VERL_REPLAY_MODULE in sys.modules
    return out
