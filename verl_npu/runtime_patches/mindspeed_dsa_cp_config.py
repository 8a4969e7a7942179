"""Keep MindSpeed's DSA context-parallel config wrapper across its own ``repatch``.

Changes: wraps ``mindspeed.megatron_adaptor.repatch``; after MindSpeed's own repatch, when its DSA feature wants
kv-allgather context parallelism (variant ``dsa``, CP > 1, ``context_parallel_algo=kvallgather_cp_algo``), MindSpeed's
``transformer_config_post_init_wrapper`` from ``dsa_kvallgather_context_parallel`` is registered with MindSpeed's own
patch manager on ``TransformerConfig.__post_init__`` and the manager re-applies its patches. Nothing else changes.
Why: in MindSpeed core_r0.18.0 the DSA feature installs that wrapper by plain assignment
(``TransformerConfig.__post_init__ = wrapper(...)``) inside ``repatch``; the same ``repatch`` then lets
``MindSpeedPatchesManager.apply_patches`` re-apply the managed patch the always-on NpuEnhancement feature registers
on the same attribute, rebuilt from the original function the manager kept, so the CP wrapper is lost and
``MLATransformerConfig(context_parallel_size>1, experimental_attention_variant="dsa")`` raises megatron-core's
"Currently context parallelism is not supported by DSAttention!" (docs/ascend_contracts.md, "What runs for real on
the CPU"; the ascend_sim tier reproduces it with MindSpeed's full features list). Registered with the manager, the
wrapper survives every later ``repatch`` too: the manager clears its wrappers on removal and this patch registers it
again after each one. The manager keeps one copy of a wrapper, so a MindSpeed that registers it itself is not
wrapped twice.
Upstream: MindSpeed core_r0.18.0 mindspeed/megatron_adaptor.py::repatch;
features_manager/transformer/experimental_attention_variant/dsa.py (DeepSeekSparseAttention.register_patches);
features_manager/npu_enhancement/npu_enhancement.py (NpuEnhancementFeature._register_config_patches).
Remove when: MindSpeed registers the kv-allgather CP wrapper through MindSpeedPatchesManager (contract
mindspeed-dsa-cp-wrapper-by-assignment fails then).
"""

from __future__ import annotations

import functools

from verl_npu.contracts.mindspeed import DSA_CP_ALGORITHM, DSA_FEATURE_CLASS, POST_INIT_TARGET
from verl_npu.patching import Patch
from verl_npu.runtime_patches._targets import MEGATRON_CORE


def _dsa_feature():
    from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager

    return next((f for f in MindSpeedFeaturesManager.FEATURES_LIST if type(f).__name__ == DSA_FEATURE_CLASS), None)


def wants_kv_allgather_cp(args) -> bool:
    """MindSpeed's DSA feature's own test for its CP wrapper, on the arguments repatch left (its is_need_apply and
    CP-size reader, then the algorithm it compares with)."""
    feature = _dsa_feature()
    return (
        feature is not None
        and feature.is_need_apply(args)
        and feature._get_context_parallel_size(args) > 1
        and getattr(args, "context_parallel_algo", None) == DSA_CP_ALGORITHM
    )


def keep_dsa_cp_wrapper() -> bool:
    """Register MindSpeed's CP wrapper with its patch manager where its DSA feature wants it; True when it did."""
    from mindspeed.args_utils import get_full_args

    if not wants_kv_allgather_cp(get_full_args()):
        return False
    from mindspeed.core.transformer.experimental_attention_variant.dsa_kvallgather_context_parallel import (
        transformer_config_post_init_wrapper,
    )
    from mindspeed.patch_utils import MindSpeedPatchesManager

    MindSpeedPatchesManager.register_patch(POST_INIT_TARGET, transformer_config_post_init_wrapper)
    MindSpeedPatchesManager.apply_patches()
    return True


def _build(original):
    @functools.wraps(original)
    def repatch(args):
        result = original(args)
        keep_dsa_cp_wrapper()
        return result

    return repatch


PATCH = Patch(
    id="mindspeed-dsa-cp-config",
    target="mindspeed.megatron_adaptor:repatch",
    kind="wrap",
    platforms=frozenset({"ascend"}),
    requires=MEGATRON_CORE,
    source_sha256="987b857efb819b304d7ba2de93f53a2a095121bff2e48031652eba4eb576ecdc",
    reason="MindSpeed's repatch assigns its DSA kv-allgather CP wrapper to TransformerConfig.__post_init__ and then "
    "re-applies its managed NpuEnhancement patch of the same attribute, which drops the wrapper: a DSA model at CP > 1 "
    "fails to build its config; the wrapper is registered with MindSpeed's patch manager after each repatch",
    upstream="MindSpeed core_r0.18.0 mindspeed/megatron_adaptor.py::repatch, features_manager/transformer/"
    "experimental_attention_variant/dsa.py::DeepSeekSparseAttention.register_patches",
    remove_when="MindSpeed registers the kv-allgather CP wrapper through MindSpeedPatchesManager (contract "
    "mindspeed-dsa-cp-wrapper-by-assignment)",
    build=_build,
)
PATCHES = (PATCH,)
