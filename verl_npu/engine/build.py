"""The NPU Megatron engine's build steps, without verl's driver stack: what the engine does around mbridge.

verl 0.9.1's Megatron engine (vanilla mbridge) builds a model as ``AutoBridge.from_config`` ->
``set_extra_args(override_transformer_config)`` -> ``bridge.get_model`` -> ``bridge.load_weights``. The verl-npu
engine (verl_npu.engine.verl_engine) adds these steps around it, in this order, and ``verl-npu parity run`` calls
the same functions on machines that do not carry verl's Ray-based stack (the CUDA reference device):

1. :func:`engine_overrides`: the build plan's TransformerConfig overrides (MindSpeed-only flags removed) and its
   DDP overrides under the user's;
2. :func:`enter_mindspeed`: MindSpeed's ``repatch`` with the plan's arguments (Ascend);
3. :func:`adapt_bridge`: off Ascend, the bridge builds on megatron-core's local spec (fused RMSNorm, DSA, no TE);
4. :func:`adapt_module`: the local spec's models take verl's right-padding mask.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl_npu.engine.build_plan import BuildPlan
from verl_npu.engine.layer_spec import needs_local_spec
from verl_npu.engine.mbridge_local import build_on_local_spec, install_mask_adapter


def engine_overrides(plan: BuildPlan, user_ddp_overrides: Mapping[str, Any] | None) -> tuple[dict, dict]:
    """(override_transformer_config, override_ddp_config) the engine builds with: MindSpeed-only flags are not
    TransformerConfig fields, and the user's DDP settings win over the plan's."""
    return dict(plan.transformer_overrides), {**plan.ddp_overrides, **dict(user_ddp_overrides or {})}


def enter_mindspeed(plan: BuildPlan) -> None:
    """MindSpeed re-applies its patches with the plan's arguments (only where the plan has them: Ascend)."""
    if plan.mindspeed_repatch is not None:
        from mindspeed.megatron_adaptor import repatch

        repatch(dict(plan.mindspeed_repatch))


def adapt_bridge(bridge: Any, plan: BuildPlan) -> bool:
    """Point the bridge at the local spec where the plan needs it; True when it did."""
    if not needs_local_spec(plan.platform, plan.features):
        return False
    build_on_local_spec(bridge, fused_rmsnorm="fused_rmsnorm" in plan.features)
    return True


def adapt_module(bridge: Any, module: list[Any]) -> None:
    """The mask adapter on a local-spec model (verl passes [batch, seq] right-padding masks)."""
    if getattr(bridge, "_verl_npu_local_spec", None) is not None:
        install_mask_adapter(module)
