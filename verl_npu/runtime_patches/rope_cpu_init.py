"""Make MLA's and the DSA indexer's rotary embeddings honour ``config.use_cpu_initialization``.

Changes: wraps ``MultiLatentAttention.__init__`` and ``DSAIndexer.__init__`` to mark (in a context
variable) that their modules are built with CPU initialisation, and wraps
``RotaryEmbedding.__init__`` / ``YarnRotaryEmbedding.__init__`` to use that mark when the caller
did not pass ``use_cpu_initialization``.
Why: GPTModel passes ``config.use_cpu_initialization`` to its rotary embedding, but MLA attention
and the DSA indexer build their own without it, so ``inv_freq`` is created with
``torch.cuda.current_device()`` and an MLA/DSA model cannot be built on a CPU-only machine (CI) even
when the config asks for CPU initialisation.
Upstream: megatron-core 0.18.0 transformer/multi_latent_attention.py (MultiLatentAttention.__init__),
transformer/experimental_attention_variant/dsa.py (DSAIndexer.__init__),
models/common/embeddings/rotary_pos_embedding.py, yarn_rotary_pos_embedding.py.
Remove when: MLA and DSAIndexer pass use_cpu_initialization to their rotary embeddings.
"""

from __future__ import annotations

import contextvars
import functools

from verl_npu.patching import Patch
from verl_npu.runtime_patches._targets import DSA_MODULE, EVERY_PLATFORM, MEGATRON_CORE

_BUILDING_ON_CPU: contextvars.ContextVar[bool] = contextvars.ContextVar("verl_npu_rope_cpu_init", default=False)
REMOVE_WHEN = "MLA and DSAIndexer pass config.use_cpu_initialization to their rotary embeddings"


def _build_owner_init(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        token = _BUILDING_ON_CPU.set(bool(config.use_cpu_initialization))
        try:
            original(self, config, *args, **kwargs)
        finally:
            _BUILDING_ON_CPU.reset(token)

    return __init__


def _build_rope_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if "use_cpu_initialization" not in kwargs and _BUILDING_ON_CPU.get():
            kwargs["use_cpu_initialization"] = True
        original(self, *args, **kwargs)

    return __init__


INDEXER = Patch(
    id="dsa-indexer-cpu-init",
    target=f"{DSA_MODULE}:DSAIndexer.__init__",
    kind="wrap",
    platforms=EVERY_PLATFORM,
    requires=MEGATRON_CORE,
    source_sha256="0f1315e246c3eb240b6a4391faed6da19205274b2a584bf1beb5b8eaac67b040",
    reason="DSAIndexer builds its rotary embedding on torch.cuda.current_device() even with use_cpu_initialization",
    upstream="megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py::DSAIndexer.__init__",
    remove_when=REMOVE_WHEN,
    build=_build_owner_init,
)

MLA = Patch(
    id="mla-cpu-init",
    target="megatron.core.transformer.multi_latent_attention:MultiLatentAttention.__init__",
    kind="wrap",
    platforms=EVERY_PLATFORM,
    requires=MEGATRON_CORE,
    source_sha256="7e586ab64bad717729e77b39306992172e7c9f9abe37b04d7fbdc5f384daf6e1",
    reason="MLA builds its rotary embedding on torch.cuda.current_device() even with use_cpu_initialization",
    upstream="megatron-core 0.18.0 transformer/multi_latent_attention.py::MultiLatentAttention.__init__",
    remove_when=REMOVE_WHEN,
    build=_build_owner_init,
)

ROPE = Patch(
    id="rope-cpu-init",
    target="megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.__init__",
    kind="wrap",
    platforms=EVERY_PLATFORM,
    requires=MEGATRON_CORE,
    source_sha256="a90792e84777f23b6f5edb742bec00a1510351b25f7f9bca8ac55aa8f3f997c0",
    reason="lets the RotaryEmbedding of MLA and the DSA indexer follow config.use_cpu_initialization",
    upstream="megatron-core 0.18.0 models/common/embeddings/rotary_pos_embedding.py::RotaryEmbedding.__init__",
    remove_when=REMOVE_WHEN,
    build=_build_rope_init,
)

YARN = Patch(
    id="yarn-rope-cpu-init",
    target="megatron.core.models.common.embeddings.yarn_rotary_pos_embedding:YarnRotaryEmbedding.__init__",
    kind="wrap",
    platforms=EVERY_PLATFORM,
    requires=MEGATRON_CORE,
    source_sha256="ca720c8478790bcbc198fb9487530a35d77a42b84d6c7e0cfcbb67f5d98a27fa",
    reason="lets the YarnRotaryEmbedding of MLA and the DSA indexer follow config.use_cpu_initialization",
    upstream="megatron-core 0.18.0 models/common/embeddings/yarn_rotary_pos_embedding.py::YarnRotaryEmbedding.__init__",
    remove_when=REMOVE_WHEN,
    build=_build_rope_init,
)

PATCHES = (MLA, INDEXER, ROPE, YARN)
