"""The DSA indexer's Hadamard rotation: off where the reference skips it, PyTorch where the CUDA extension is missing.

Changes: replaces ``megatron.core...dsa.rotate_activation`` with one that
* returns its input unchanged inside a GLM-5 IndexShare layer whose spec says the indexer does not
  rotate (verl_npu.engine.index_share: every ``glm_moe_dsa`` model);
* otherwise rotates like megatron (Hadamard of the last dimension, scaled by its size**-0.5, bf16
  in and out): megatron's own ``fast_hadamard_transform`` where that CUDA extension is installed,
  else ``verl_npu.ops.dispatch.hadamard_transform`` (portable, on NPU, CUDA and CPU).
Why: megatron-core 0.18's DSA indexer rotates q and k with ``fast_hadamard_transform``, which is
CUDA-only, and ``rotate_activation`` asserts it is installed, so DSA could not run on Ascend (where
it never is) nor on machines without it. And the reference implementation GLM-5's rollout follows
(transformers' GlmMoeDsa, vLLM's bf16 path) computes the index scores without the rotation: it is
orthogonal, so it changes nothing in exact arithmetic, but in bf16 it rounds q and k and moves the
top-k selection (measured: tests_npu/engine/test_index_share.py), so training would select different keys
than the rollout.
Upstream: megatron-core 0.18.0 megatron/core/transformer/experimental_attention_variant/dsa.py
(rotate_activation).
Remove when: megatron-core ships a non-CUDA Hadamard path for DSA and lets a model skip the rotation.
"""

from __future__ import annotations

import sys

import torch

from verl_npu.engine import index_share
from verl_npu.ops import dispatch
from verl_npu.patching import Patch
from verl_npu.runtime_patches._targets import DSA_MODULE, EVERY_PLATFORM, MEGATRON_CORE


def _build(original):
    def rotate_activation(x: torch.Tensor) -> torch.Tensor:
        """Hadamard rotation of the last dimension, scaled by its size**-0.5 (bf16 in, bf16 out)."""
        if not index_share.indexer_rotates():
            return x  # any dtype: nothing is computed
        assert x.dtype == torch.bfloat16, f"rotate_activation only support bf16 input, but got {x.dtype}"
        if original is not None and getattr(sys.modules.get(DSA_MODULE), "hadamard_transform", None) is not None:
            return original(x)
        return dispatch.hadamard_transform(x, scale=x.size(-1) ** -0.5)

    return rotate_activation


PATCH = Patch(
    id="dsa-indexer-rotation",
    target=f"{DSA_MODULE}:rotate_activation",
    kind="replace",
    platforms=EVERY_PLATFORM,
    requires=MEGATRON_CORE,
    source_sha256="9e24698e62e7c66a025514754dcaeaaaab20d0b82b6766795d0ad20e80790652",
    reason="the DSA indexer's rotation needs the CUDA-only fast_hadamard_transform (a PyTorch fallback here), and "
    "GLM-5's reference computes the index scores without it (off in its IndexShare layers)",
    upstream="megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py::rotate_activation",
    remove_when="megatron-core provides a non-CUDA Hadamard path for DSA and lets a model skip the rotation",
    build=_build,
)
PATCHES = (PATCH,)
