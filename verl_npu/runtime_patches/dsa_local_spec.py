"""Let megatron-core's DSA attention build on the local (non-TransformerEngine) spec.

Changes: adds ``LocalSpecProvider.linear()`` returning ``DuplicatedLinear``, and, only where
TransformerEngine is absent, sets ``multi_latent_attention.Linear`` (``None`` without TE) to the same
class so MLA accepts it for its q/kv down projections.
Why: ``get_dsa_module_spec_for_backend`` calls ``backend.linear()`` for the indexer projections
(built with ``parallel_mode="duplicated"``) and the MLA down projections; only TE's provider has
``linear()``, so DSA cannot be built with the local provider on Ascend, on CUDA without TE or on CPU.
Upstream: megatron-core 0.18.0 models/backends.py (LocalSpecProvider),
models/gpt/experimental_attention_variant_module_specs.py (get_dsa_module_spec_for_backend),
transformer/multi_latent_attention.py (MLASelfAttention.__init__).
Remove when: LocalSpecProvider provides linear() and MLA accepts it without TransformerEngine.
"""

from __future__ import annotations

import sys

from verl_npu.engine.modules import DuplicatedLinear
from verl_npu.patching import Patch
from verl_npu.runtime_patches._targets import EVERY_PLATFORM, MEGATRON_CORE

MLA_MODULE = "megatron.core.transformer.multi_latent_attention"


def _build_linear(_original):
    def linear(self) -> type:
        """Which linear module the local backend uses for duplicated (non-parallel) projections."""
        return DuplicatedLinear

    return linear


def _build_mla_linear(_original):
    return DuplicatedLinear


def _te_present() -> str | None:
    if getattr(sys.modules[MLA_MODULE], "Linear", None) is not None:
        return "TransformerEngine is installed; MLA keeps its own Linear"
    return None


LOCAL_LINEAR = Patch(
    id="dsa-local-spec-linear",
    target="megatron.core.models.backends:LocalSpecProvider.linear",
    kind="add",
    platforms=EVERY_PLATFORM,
    requires=MEGATRON_CORE,
    source_sha256="344b285815be40409b6685789bf8168d7427aeae3bb7abacfc268764f36c7786",
    reason="the DSA spec calls backend.linear(), which the local spec provider lacks",
    upstream="megatron-core 0.18.0 models/backends.py::LocalSpecProvider",
    remove_when="LocalSpecProvider defines linear()",
    build=_build_linear,
)

MLA_LINEAR = Patch(
    id="mla-accepts-duplicated-linear",
    target=f"{MLA_MODULE}:Linear",
    kind="replace",
    platforms=EVERY_PLATFORM,
    requires=MEGATRON_CORE,
    source_sha256="0ea59ca2dfa2f1a960fdc3724f16e51c7cb659a4b285bb2d45d7f6544f90ab93",
    reason="without TransformerEngine MLA's Linear is None and MLA rejects the local linear() for its down projections",
    upstream="megatron-core 0.18.0 transformer/multi_latent_attention.py::MLASelfAttention.__init__",
    remove_when="MLA accepts a local duplicated linear without TransformerEngine",
    build=_build_mla_linear,
    condition=_te_present,
    fingerprint_of="MLASelfAttention.__init__",
)

PATCHES = (LOCAL_LINEAR, MLA_LINEAR)
