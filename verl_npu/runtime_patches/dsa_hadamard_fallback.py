"""A pure-PyTorch Hadamard rotation for the DSA indexer where fast_hadamard_transform is missing.

Changes: replaces ``megatron.core...dsa.rotate_activation`` with one that calls
``verl_npu.ops.dispatch.hadamard_transform`` (same scale ``hidden**-0.5``, same shape and dtype;
its only backend today is the portable ``verl_npu.ops.hadamard``, on NPU, CUDA and CPU).
Why: megatron-core 0.18's DSA indexer rotates q and k with the CUDA-only ``fast_hadamard_transform``
extension. Its import is guarded (a missing extension leaves ``dsa.hadamard_transform = None``),
but ``rotate_activation`` asserts it is installed, so DSA cannot run on Ascend (never installed
there) nor on machines without that extension. Only applied when the extension is absent.
Upstream: megatron-core 0.18.0 megatron/core/transformer/experimental_attention_variant/dsa.py
(rotate_activation).
Remove when: megatron-core ships a fallback, or the Ascend fused indexer path never calls it.
"""

from __future__ import annotations

import sys

import torch

from verl_npu.ops import dispatch
from verl_npu.patching import Patch

DSA_MODULE = "megatron.core.transformer.experimental_attention_variant.dsa"


def _build(original):
    def rotate_activation(x: torch.Tensor) -> torch.Tensor:
        """Hadamard rotation of the last dimension, scaled by its size**-0.5 (bf16 in, bf16 out)."""
        assert x.dtype == torch.bfloat16, f"rotate_activation only support bf16 input, but got {x.dtype}"
        return dispatch.hadamard_transform(x, scale=x.size(-1) ** -0.5)

    return rotate_activation


def _extension_missing() -> str | None:
    if getattr(sys.modules[DSA_MODULE], "hadamard_transform", None) is not None:
        return "fast_hadamard_transform is installed; megatron's own rotation is used"
    return None


PATCH = Patch(
    id="dsa-hadamard-fallback",
    target=f"{DSA_MODULE}:rotate_activation",
    kind="replace",
    platforms=frozenset({"ascend", "cuda", "cpu"}),
    requires={"megatron-core": "==0.18.0"},
    source_sha256="9e24698e62e7c66a025514754dcaeaaaab20d0b82b6766795d0ad20e80790652",
    reason="the DSA indexer needs the CUDA-only fast_hadamard_transform; this is a PyTorch fallback",
    upstream="megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py::rotate_activation",
    remove_when="megatron-core provides a non-CUDA Hadamard path for DSA",
    build=_build,
    condition=_extension_missing,
)
