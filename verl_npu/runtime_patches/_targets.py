"""What several runtime patches state alike: the upstream module they target, the release they were
reviewed against and the platforms they apply on. Each is written here once; the patch modules import it.
"""

from __future__ import annotations

from types import MappingProxyType

from verl_npu.patching import PLATFORMS

# megatron-core's DeepSeek Sparse Attention (DSAttention, DSAIndexer, the indexer loss)
DSA_MODULE = "megatron.core.transformer.experimental_attention_variant.dsa"
# the megatron-core release whose source every megatron patch fingerprints (verl_npu/stack/stack.toml)
MEGATRON_CORE = MappingProxyType({"megatron-core": "==0.18.0"})
# a patch that applies wherever verl-npu runs: Ascend, CUDA and CPU
EVERY_PLATFORM = PLATFORMS
