"""verl-npu's runtime patches, one module per change; ``ALL`` is the registry the layer applies.

Each module states what it changes, why, the upstream code it targets and when to remove it, and
exports its patches as ``PATCHES`` (a tuple); constants several of them share are in ``_targets``.
docs/patches.md is generated from this registry (`verl-npu patches --markdown`).
"""

from verl_npu.runtime_patches import (
    dsa_call_context,
    dsa_index_share,
    dsa_indexer_loss,
    dsa_indexer_rotation,
    dsa_indexer_topk_eval,
    dsa_indexer_without_loss,
    dsa_local_spec,
    dsa_sparse_attention,
    mbridge_glm5,
    mbridge_instance_mapping,
    mindspeed_dsa_cp_config,
    mindspeed_router_replay,
    ray_runtime_env,
    rope_cpu_init,
    router_replay_padded,
)

# in the order the layer applies them
MODULES = (
    ray_runtime_env,
    mindspeed_dsa_cp_config,
    mindspeed_router_replay,
    dsa_indexer_rotation,
    dsa_call_context,
    dsa_sparse_attention,
    dsa_indexer_without_loss,
    dsa_indexer_loss,
    dsa_indexer_topk_eval,
    dsa_index_share,
    dsa_local_spec,
    rope_cpu_init,
    mbridge_glm5,
    mbridge_instance_mapping,
    router_replay_padded,
)

ALL = tuple(patch for module in MODULES for patch in module.PATCHES)
