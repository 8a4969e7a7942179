"""verl-npu's runtime patches, one module per change; ``ALL`` is the registry the layer applies.

Each module states what it changes, why, the upstream code it targets and when to remove it.
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
    ray_runtime_env,
    rope_cpu_init,
)

ALL = (
    ray_runtime_env.PATCH,
    dsa_indexer_rotation.PATCH,
    dsa_call_context.PATCH,
    dsa_sparse_attention.PATCH,
    *dsa_indexer_without_loss.PATCHES,
    dsa_indexer_loss.PATCH,
    *dsa_indexer_topk_eval.PATCHES,
    *dsa_index_share.PATCHES,
    *dsa_local_spec.PATCHES,
    *rope_cpu_init.PATCHES,
    mbridge_glm5.PATCH,
)
