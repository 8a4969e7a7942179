"""Keep verl's MoE router replay patches in effect across a later MindSpeed ``repatch`` in the same process.

Changes: wraps ``MindSpeedFeaturesManager.apply_features_patches`` (the last step of MindSpeed's ``repatch``). After
MindSpeed has re-applied its patches, every replay patch verl had installed (verl's own flag on the class says so)
that MindSpeed has since assigned over is put back: verl's own ``apply_router_replay_patch`` runs again with that
patch's flag dropped, so verl's code wraps whatever MindSpeed installed now (``MoEAlltoAllTokenDispatcher.preprocess``,
``TransformerConfig.__init__``); ``TopKRouter.routing`` gets verl's ``patched_routing`` back (verl's code would also
wrap ``TopKRouter.__init__`` a second time, registering every router twice). verl clears its router registry
(``RouterReplay.router_instances``) on every call: the routers registered before are put back in the same list, in
order. Nothing changes where verl's replay patch has not run (no verl flag is set; this patch imports nothing of
verl's). Target: ``repatch`` itself is wrapped by mindspeed-dsa-cp-config (one patch per target); MindSpeed's
``repatch`` ends with ``apply_features_patches`` (contract mindspeed-repatch-sets-every-key), the step that re-assigns
its managed attributes, and MindSpeed's import runs it before verl can have patched anything. Its pre-patch step and
``remove_patches`` come earlier in ``repatch``, so putting verl's patches back there would be undone at once.
Why: verl's Megatron engine installs its replay patches after ``_init_device_mesh``, where verl-npu's engine runs
MindSpeed's ``repatch`` (verl_npu/engine/verl_engine.py); a second engine in the process (reference model, critic)
runs ``repatch`` again. MindSpeed's patch manager then sets each managed attribute from the original it kept
(contract mindspeed-patch-manager-overwrites-foreign-patches), dropping verl's wrappers, while verl's flags stay and
keep verl from patching again. With MindSpeed's fused MoE permutation and the alltoall dispatcher MindSpeed manages
``preprocess`` (contract mindspeed-fused-permute-manages-alltoall-preprocess): without verl's wrapper a replayed
duplicate expert collapses in ``routing_map`` but ``num_out_tokens`` stays tokens x top-k. The always-on
NpuEnhancement feature manages ``TransformerConfig.__init__``, so verl's config wrapper goes on every later
``repatch`` (harmless on megatron-core 0.18, where verl sets ``moe_enable_routing_replay`` on the built config, but
verl's patch is put back all the same). MindSpeed manages ``TopKRouter.routing`` only with ``moe_tp_extend_ep``, which
cannot repatch over megatron-core 0.18 (contract mindspeed-tp-extend-ep-manages-routing); and at this commit its fused
permutation also wraps the dispatcher's ``__init__`` without megatron-core 0.18's process groups (contract
mindspeed-fused-permute-dispatcher-init-without-process-groups), so no MoE layer builds under it: both are for the
build plan to refuse; this patch keeps verl's replay right once they build.
tests_npu/patching/test_ascend_sim_router_replay.py executes all of it over MindSpeed's source.
Upstream: verl 0.9.1 verl/utils/megatron/router_replay_patch.py::apply_router_replay_patch; MindSpeed core_r0.18.0
mindspeed/features_manager/features_manager.py::MindSpeedFeaturesManager.apply_features_patches,
mindspeed/patch_utils.py::Patch.apply_patch, features_manager/fusions/fused_moe_permute.py (preprocess),
features_manager/moe/tp_extend_ep.py (routing).
Remove when: verl re-checks that its replay patches are in place instead of trusting its class flags, or MindSpeed's
patch manager stops assigning over attributes it no longer holds (contract
mindspeed-patch-manager-overwrites-foreign-patches fails then).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from typing import Any

from verl_npu.patching import Patch, PatchDriftError
from verl_npu.runtime_patches._targets import MEGATRON_CORE

logger = logging.getLogger(__name__)

VERL_REPLAY_MODULE = "verl.utils.megatron.router_replay_patch"
# What verl's replay patch installs: (owner.attribute, verl's flag on the owner, verl's function). patched_routing is
# a function of verl's module, the others are defined inside apply_router_replay_patch.
_VERL_PATCHES = (
    ("MoEAlltoAllTokenDispatcher.preprocess", "_preprocess_patched", "patched_preprocess"),
    ("TransformerConfig.__init__", "_verl_router_patched", "patched_tf_config_init"),
    ("TopKRouter.__init__", "_router_replay_patched", "patched_init"),
    ("TopKRouter.routing", "_router_replay_patched", "patched_routing"),
)
_VERL_NESTED = frozenset(function for *_, function in _VERL_PATCHES) - {"patched_routing"}
_WRAPPER_CHAIN_LIMIT = 64  # a chain of __wrapped__ longer than this is a cycle, not a stack of patches


@dataclasses.dataclass(frozen=True)
class VerlReplayPatch:
    """One attribute verl's replay patch installs a function on, and the class flag verl marks it with."""

    label: str
    owner: type
    attribute: str
    flag: str
    code: Any  # the code object of verl's function

    def installed(self) -> bool:
        return bool(getattr(self.owner, self.flag, False))

    def chain(self) -> list[Any]:
        """What the attribute runs, outermost first (each functools.wraps wrapper, then what it wraps)."""
        functions, function = [], getattr(self.owner, self.attribute, None)
        while function is not None and len(functions) < _WRAPPER_CHAIN_LIMIT:
            functions.append(function)
            function = getattr(function, "__wrapped__", None)
        return functions

    def in_effect(self) -> bool:
        return any(getattr(f, "__code__", None) is self.code for f in self.chain())

    def describe(self) -> str:
        names = [getattr(getattr(f, "__code__", None), "co_qualname", repr(f)) for f in self.chain()]
        return f"{self.label} runs {' -> '.join(names) or 'nothing'}"


def _drift(expected: str, found: str) -> PatchDriftError:
    return PatchDriftError(
        f"verl-npu patch {PATCH.id}: expected {expected}, found {found} (this patch was written for verl 0.9.1's "
        "router replay patch over MindSpeed core_r0.18.0); review verl_npu/runtime_patches/mindspeed_router_replay.py"
    )


def _owners() -> dict[str, type]:
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    return {cls.__name__: cls for cls in (MoEAlltoAllTokenDispatcher, TransformerConfig, TopKRouter)}


def verl_replay_patches(replay) -> tuple[VerlReplayPatch, ...]:
    """verl's replay patches in ``replay`` (verl's module), checked against what this patch was written for."""
    owners = _owners()
    missing = [n for n in ("apply_router_replay_patch", "patched_routing", "RouterReplay") if not hasattr(replay, n)]
    if missing:
        raise _drift("apply_router_replay_patch, patched_routing and RouterReplay in verl's module", f"no {missing}")
    if hasattr(owners["TopKRouter"], "_hash_routing"):  # verl then patches the hash router, none of the targets here
        raise _drift("megatron-core's TopKRouter without _hash_routing (0.18.0)", "TopKRouter._hash_routing")
    functions = {c.co_name: c for c in replay.apply_router_replay_patch.__code__.co_consts if hasattr(c, "co_name")}
    absent = sorted(_VERL_NESTED - set(functions))
    if absent:
        raise _drift(f"{sorted(_VERL_NESTED)} defined in apply_router_replay_patch", f"none named {absent}")
    functions["patched_routing"] = replay.patched_routing.__code__
    patches = []
    for label, flag, function in _VERL_PATCHES:
        owner, attribute = label.split(".", 1)
        patches.append(VerlReplayPatch(label, owners[owner], attribute, flag, functions[function]))
    return tuple(patches)


def _rerun_verl(replay, flags: set[tuple[type, str]]) -> None:
    """verl's own apply_router_replay_patch with ``flags`` dropped; its router registry as it was before."""
    registry = replay.RouterReplay.router_instances
    registered = list(registry)
    for owner, flag in flags:
        if flag not in vars(owner):
            raise _drift(f"verl's flag {flag} set on {owner.__name__} itself", "it is inherited")
        delattr(owner, flag)
    try:
        replay.apply_router_replay_patch()
    finally:
        replay.RouterReplay.router_instances = registry
        registry[:] = registered


def restore_verl_router_replay() -> tuple[str, ...]:
    """Put back each replay patch verl had installed that is no longer in effect; returns what was put back."""
    replay = sys.modules.get(VERL_REPLAY_MODULE)
    if replay is None:  # verl's replay patch never ran in this process
        return ()
    owners = _owners()
    if not any(getattr(owners[label.split(".")[0]], flag, False) for label, flag, _ in _VERL_PATCHES):
        return ()  # verl's module is loaded (its engine imports it) but replay is off: nothing of verl's to keep
    displaced = {p.label: p for p in verl_replay_patches(replay) if p.installed() and not p.in_effect()}
    if not displaced:
        return ()
    if "TopKRouter.routing" in displaced and "TopKRouter.__init__" not in displaced:
        # verl's code would wrap the router's __init__ a second time (every router registered twice)
        routing = displaced["TopKRouter.routing"]
        setattr(routing.owner, routing.attribute, replay.patched_routing)
    rerun = {(p.owner, p.flag) for p in displaced.values() if p.label != "TopKRouter.routing"}
    if rerun:
        _rerun_verl(replay, rerun)
    still = [p.describe() for p in displaced.values() if not p.in_effect()]
    if still:
        raise _drift("verl's replay patches in effect after putting them back", "; ".join(still))
    logger.info("verl-npu: verl's router replay patches put back after MindSpeed's repatch: %s", sorted(displaced))
    return tuple(displaced)


def _build(original):
    apply_features_patches = original.__func__

    @functools.wraps(apply_features_patches)
    def keep_router_replay(cls, mindspeed_args):
        result = apply_features_patches(cls, mindspeed_args)
        restore_verl_router_replay()
        return result

    return classmethod(keep_router_replay)


PATCH = Patch(
    id="mindspeed-router-replay",
    target="mindspeed.features_manager.features_manager:MindSpeedFeaturesManager.apply_features_patches",
    kind="wrap",
    platforms=frozenset({"ascend"}),
    requires={"verl": "==0.9.1", **MEGATRON_CORE},
    source_sha256="0dda0beeb864abd98392f8cf532000b1f3a7baf70df2489d4eefcc0c6bfb52e4",
    reason="a second engine's MindSpeed repatch re-sets the attributes MindSpeed manages over verl's router replay "
    "patches (the alltoall dispatcher's preprocess with MindSpeed's fused MoE permutation, TransformerConfig.__init__) "
    "while verl's flags keep verl from patching again, so replayed duplicate experts no longer set num_out_tokens; "
    "after each repatch verl's patches that were displaced are put back, its router registry kept",
    upstream="verl 0.9.1 verl/utils/megatron/router_replay_patch.py::apply_router_replay_patch; MindSpeed "
    "core_r0.18.0 mindspeed/features_manager/features_manager.py::MindSpeedFeaturesManager.apply_features_patches, "
    "mindspeed/patch_utils.py::Patch.apply_patch",
    remove_when="verl checks that its replay patches are still in place instead of trusting its class flags, or "
    "MindSpeed stops assigning over attributes it no longer holds (contract "
    "mindspeed-patch-manager-overwrites-foreign-patches)",
    build=_build,
)
PATCHES = (PATCH,)
