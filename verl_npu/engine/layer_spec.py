"""Decoder block specs on megatron-core's local modules, with DSA attention and the RMSNorm swap.

The engine builds on these off Ascend whenever TransformerEngine is absent or a feature needs
modules TE's spec fuses away (``use_fused_rmsnorm`` swaps the norm class; TE fuses the input norm
into the QKV projection, so there is no norm class to swap). Both the GLM-5 test model and verl's
mbridge-built models (verl_npu.engine.mbridge_local) take their layers from here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def needs_local_spec(platform: str, features: tuple[str, ...]) -> bool:
    """Off Ascend, build on the local spec without TE, and for fused RMSNorm or DSA."""
    if platform == "ascend":
        return False  # TransformerEngineNPU + MindSpeed provide the fused modules
    return not transformer_engine_available() or "fused_rmsnorm" in features or "dsa" in features


def dsa_attention_spec(config, backend):
    """megatron-core's DSA attention spec; without a fused layernorm-linear, q/kv norms stand alone."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend

    fused = backend.column_parallel_layer_norm_linear() is not None
    if fused or not config.qk_layernorm:
        return get_dsa_module_spec_for_backend(config, backend=backend)
    # Same math as the fused path: norm(x) then the up projection, as two modules.
    spec = get_dsa_module_spec_for_backend(dataclasses.replace(config, qk_layernorm=False), backend=backend)
    norm = backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=True)
    spec.submodules.q_layernorm = norm
    spec.submodules.kv_layernorm = norm
    return spec


def _spec_fields(spec: Any):
    """(submodules, field name, value) for every field of every spec in a module spec tree."""
    submodules = getattr(spec, "submodules", None)
    if submodules is None or not dataclasses.is_dataclass(submodules):
        return
    for field in dataclasses.fields(submodules):
        value = getattr(submodules, field.name)
        yield submodules, field.name, value
        if hasattr(value, "submodules"):
            yield from _spec_fields(value)


def swap_norms(spec: Any, replacement: type) -> None:
    """Replace megatron's local RMSNorm builder everywhere in a module spec tree (not DSA's k_norm)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    for submodules, name, value in list(_spec_fields(spec)):
        # the DSA indexer's key norm is a LayerNorm by design (see local_decoder_block_spec)
        if value is WrappedTorchNorm and name != "k_norm":
            setattr(submodules, name, replacement)


def local_layer_norms_and_attention(spec: Any) -> None:
    """Local modules megatron's own would refuse: SP-capable DSA key norm, THD-capable core attention.

    megatron's ``WrappedTorchNorm`` asserts sequence_parallel=False (so TP=2+SP could not build DSA),
    and its ``DotProductAttention`` refuses packed THD batches (verl's ``use_remove_padding`` path).
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from verl_npu.engine.modules import LayerNorm
    from verl_npu.engine.packed_attention import PackedDotProductAttention

    for submodules, name, value in list(_spec_fields(spec)):
        if name == "k_norm" and value is WrappedTorchNorm:
            setattr(submodules, name, LayerNorm)
        elif name == "core_attention" and value is DotProductAttention:
            setattr(submodules, name, PackedDotProductAttention)


def local_decoder_block_spec(config, *, fused_rmsnorm: bool, vp_stage: int | None = None):
    """megatron's GPT decoder block on local modules, DSA attention where the config asks for it."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from verl_npu.engine.modules import RMSNorm

    if fused_rmsnorm and config.normalization != "RMSNorm":
        raise ValueError(f"use_fused_rmsnorm needs normalization='RMSNorm', the model has {config.normalization!r}")
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization=config.normalization, vp_stage=vp_stage
    )
    backend = LocalSpecProvider()
    for layer in block.layer_specs:
        if getattr(config, "experimental_attention_variant", None) == "dsa":
            layer.submodules.self_attention = dsa_attention_spec(config, backend)
        local_layer_norms_and_attention(layer)
        if fused_rmsnorm:
            swap_norms(layer, RMSNorm)
    if fused_rmsnorm:
        block.layer_norm = RMSNorm
    return block
