"""verl's MoE router replay across a second engine's MindSpeed ``repatch`` (runtime patch mindspeed-router-replay),
executed over MindSpeed's pinned source on the CPU (ascend_sim tier; scenario in
tests_npu/support/ascend_sim_router_replay.py, run in its own process).

The engines run the steps verl-npu's engine runs: build plan -> ``repatch`` with the plan's arguments (alltoall
dispatcher, MindSpeed's fused MoE permutation) -> for the actor, verl's ``apply_router_replay_patch`` and routers
registered with verl; then a second engine's ``repatch``. Replay is checked through megatron's real router (verl's
replay routing, the action set through verl's registry) and the dispatcher's real ``preprocess``: one replayed token
names expert 1 twice, so ``routing_map`` holds 7 routes, not tokens x top-k = 8, and verl's rule sets
``num_out_tokens`` to 7.
"""

from __future__ import annotations

import types

import pytest
from test_ascend_sim_mindspeed import mindspeed, run_scenario  # noqa: F401  (the tier's MindSpeed source fixture)

from verl_npu.patching import PatchDriftError
from verl_npu.runtime_patches import mindspeed_router_replay

VERL_PREPROCESS = "router_replay_patch.py:apply_router_replay_patch.<locals>.patched_preprocess"
VERL_CONFIG_INIT = "router_replay_patch.py:apply_router_replay_patch.<locals>.patched_tf_config_init"
VERL_ROUTER_INIT = "router_replay_patch.py:apply_router_replay_patch.<locals>.patched_init"
VERL_ROUTING = "router_replay_patch.py:patched_routing"
MINDSPEED_PREPROCESS = "fused_moe_permute.py:preprocess_sync_wrapper.<locals>.wrapper"
MINDSPEED_CONFIG_INIT = "arguments_basic.py:transformer_config_init_wrapper.<locals>.wrapper"
MEGATRON_PREPROCESS = "token_dispatcher.py:MoEAlltoAllTokenDispatcher.preprocess"
MEGATRON_ROUTING = "router.py:TopKRouter.routing"
REPLAYED_ROUTES, TOKENS_TIMES_TOPK = 7, 8


@pytest.fixture(scope="module")
def replay(mindspeed, tmp_path_factory) -> dict:  # noqa: F811
    tmp = tmp_path_factory.mktemp("router-replay")
    return run_scenario("router_replay", {"mindspeed": str(mindspeed["installed"])}, tmp, "ascend")


def _mentions_verl(targets: dict[str, list[str]]) -> bool:
    return any("router_replay_patch.py" in step for chain in targets.values() for step in chain)


@pytest.mark.ascend_sim
def test_the_engines_repatch_makes_mindspeed_manage_the_dispatchers_preprocess(replay):
    assert replay["status"] == "applied"
    assert replay["repatch"]["moe_token_dispatcher_type"] == "alltoall" and replay["repatch"]["moe_permute_fusion"]
    targets = replay["without_replay"]["before_verls_module"]["with_patch"]
    assert targets["MoEAlltoAllTokenDispatcher.preprocess"] == [MINDSPEED_PREPROCESS, MEGATRON_PREPROCESS]
    assert targets["TransformerConfig.__init__"][0] == MINDSPEED_CONFIG_INIT


@pytest.mark.ascend_sim
@pytest.mark.parametrize("stage", ["before_verls_module", "verls_module_imported"])
def test_without_router_replay_the_patch_changes_nothing(replay, stage):
    observed = replay["without_replay"][stage]
    assert observed["with_patch"] == observed["without_patch"]
    assert not _mentions_verl(observed["with_patch"])
    assert not any(observed["flags"].values()) and observed["restored"] == []


@pytest.mark.ascend_sim
def test_the_actor_replays_with_verls_dispatcher_rule(replay):
    actor = replay["actor"]
    assert actor["replay"] == {"routed": [REPLAYED_ROUTES] * 2, "num_out_tokens": REPLAYED_ROUTES,
                               "tokens_times_topk": TOKENS_TIMES_TOPK}  # fmt: skip
    assert actor["targets"]["MoEAlltoAllTokenDispatcher.preprocess"] == [
        VERL_PREPROCESS, MINDSPEED_PREPROCESS, MEGATRON_PREPROCESS
    ]  # fmt: skip
    assert actor["registry_holds_the_first_engines_routers_in_order"]


@pytest.mark.ascend_sim
def test_without_the_patch_a_second_engines_repatch_drops_verls_patches_and_its_flags_stay(replay):
    """The finding: MindSpeed re-sets what it manages over verl's wrappers, verl's flags say they are in place."""
    second = replay["second_engine_without_patch"]
    assert second["replay"]["routed"] == [REPLAYED_ROUTES] * 2
    assert second["replay"]["num_out_tokens"] == TOKENS_TIMES_TOPK  # verl's rule is gone
    assert second["targets"]["MoEAlltoAllTokenDispatcher.preprocess"] == [MINDSPEED_PREPROCESS, MEGATRON_PREPROCESS]
    assert VERL_CONFIG_INIT not in second["targets"]["TransformerConfig.__init__"]
    assert all(second["flags"].values())
    # MindSpeed manages neither of the router's attributes here
    assert second["targets"]["TopKRouter.routing"] == [VERL_ROUTING]
    assert second["targets"]["TopKRouter.__init__"][0] == VERL_ROUTER_INIT


@pytest.mark.ascend_sim
@pytest.mark.parametrize("engine", ["third_engine", "fourth_engine"])
def test_with_the_patch_every_later_engine_keeps_verls_replay_and_the_actors_routers(replay, engine):
    state = replay[engine]
    assert state["replay"] == replay["actor"]["replay"]
    targets = state["targets"]
    # verl's wrapper over the function MindSpeed installed in this repatch, not an older one
    assert targets["MoEAlltoAllTokenDispatcher.preprocess"] == [
        VERL_PREPROCESS, MINDSPEED_PREPROCESS, MEGATRON_PREPROCESS
    ]  # fmt: skip
    assert state["wraps_mindspeeds_current_preprocess"]
    assert targets["TransformerConfig.__init__"][:2] == [VERL_CONFIG_INIT, MINDSPEED_CONFIG_INIT]
    # the router's __init__ wrapped once (twice would register every router twice)
    assert targets["TopKRouter.__init__"].count(VERL_ROUTER_INIT) == 1
    assert targets["TopKRouter.routing"] == [VERL_ROUTING]
    assert state["registry_is_the_same_list"] and state["registry_holds_the_first_engines_routers_in_order"]


@pytest.mark.ascend_sim
def test_putting_verls_patches_back_is_idempotent(replay):
    assert replay["restored_again"] == []
    assert replay["preprocess_unchanged_by_a_second_call"]
    assert replay["displaced"] == []


@pytest.mark.ascend_sim
def test_a_mindspeed_feature_managing_topk_routing_gets_verls_replay_routing_put_back(replay):
    assert replay["routing_managed_without_patch"] == [MEGATRON_ROUTING]
    state = replay["routing_managed"]
    assert state["targets"]["TopKRouter.routing"] == [VERL_ROUTING]
    assert state["targets"]["TopKRouter.__init__"].count(VERL_ROUTER_INIT) == 1
    assert state["replay"] == replay["actor"]["replay"]
    assert state["registry_holds_the_first_engines_routers_in_order"]


@pytest.mark.ascend_sim
def test_mindspeeds_fused_permute_dispatcher_cannot_take_megatron_0_18s_process_groups(replay):
    """Finding for the build plan: with MindSpeed's fused MoE permutation on the alltoall dispatcher, MindSpeed's
    wrapper of the dispatcher's __init__ takes no pg_collection, which megatron-core 0.18's MoELayer passes."""
    assert replay["moe_layer_refusal"].startswith("TypeError: "), replay["moe_layer_refusal"]
    assert "unexpected keyword argument 'pg_collection'" in replay["moe_layer_refusal"]
    assert "moe_permute_fusion=True with the all-to-all dispatcher" in replay["plan_refuses"]["moe_permute_fusion"]


@pytest.mark.ascend_sim
def test_mindspeeds_moe_tp_extend_ep_cannot_repatch_over_megatron_0_18(replay):
    """Finding for the build plan: MindSpeed's only feature that manages TopKRouter.routing imports megatron's
    legacy alltoall_seq dispatcher, which megatron-core 0.18 no longer has."""
    assert replay["tp_extend_ep"] == (
        "ModuleNotFoundError: No module named 'megatron.core.transformer.moe.legacy_a2a_token_dispatcher'"
    )
    assert "moe_tp_extend_ep=True: " in replay["plan_refuses"]["moe_tp_extend_ep"]


# --- verl's side, on the CPU (no MindSpeed needed) ----------------------------------------------------------------


def test_verls_replay_patches_are_found_in_verls_module():
    from verl.utils.megatron import router_replay_patch

    patches = mindspeed_router_replay.verl_replay_patches(router_replay_patch)
    assert [p.label for p in patches] == [
        "MoEAlltoAllTokenDispatcher.preprocess", "TransformerConfig.__init__", "TopKRouter.__init__",
        "TopKRouter.routing",
    ]  # fmt: skip
    assert patches[-1].code is router_replay_patch.patched_routing.__code__


def test_a_changed_verl_replay_patch_is_refused_naming_expected_and_found():
    from verl.utils.megatron import router_replay_patch

    def apply_router_replay_patch():  # a verl whose patch no longer defines the wrappers this patch puts back
        def patched_preprocess(self, routing_map):
            return routing_map

        return patched_preprocess

    changed = types.SimpleNamespace(
        apply_router_replay_patch=apply_router_replay_patch,
        patched_routing=router_replay_patch.patched_routing,
        RouterReplay=router_replay_patch.RouterReplay,
    )
    with pytest.raises(PatchDriftError, match=r"expected .*patched_tf_config_init.*found none named \['patched_init'"):
        mindspeed_router_replay.verl_replay_patches(changed)
    with pytest.raises(PatchDriftError, match=r"found no \['patched_routing'\]"):
        mindspeed_router_replay.verl_replay_patches(types.SimpleNamespace(apply_router_replay_patch=None,
                                                                          RouterReplay=None))  # fmt: skip
