"""GLM-5 and GLM-5.2 as a registered model family (verl_npu.models.family).

GLM-5's config is transformers' ``GlmMoeDsaConfig`` defaults (docs/upstream_facts.md). GLM-5.2's is its published
config.json, which this package ships as ``glm5_2_published_config.json``: a link to examples/glm5_2/config.json in
the repository (so the example and the package cannot disagree), copied into a built wheel.
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
import json
from typing import Any

from verl_npu.models import family
from verl_npu.models.glm5 import names
from verl_npu.models.glm5.config import MODEL_TYPE, glm5_config_fields, indexer_types

PUBLISHED_GLM5_2 = "glm5_2_published_config.json"


class PublishedConfigError(RuntimeError):
    """The package's copy of GLM-5.2's published config is missing or damaged: the installation is broken."""


@functools.cache
def _published_glm5_2() -> dict[str, Any]:
    resource = importlib.resources.files(__package__).joinpath(PUBLISHED_GLM5_2)
    try:
        config = json.loads(resource.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PublishedConfigError(
            f"{resource}: GLM-5.2's published config, shipped with verl-npu, cannot be read ({exc}); reinstall "
            "verl-npu (install.sh), or restore examples/glm5_2/config.json in a checkout"
        ) from None
    if not isinstance(config, dict) or config.get("model_type") != MODEL_TYPE:
        raise PublishedConfigError(f"{resource}: not a {MODEL_TYPE} config.json; reinstall verl-npu (install.sh)")
    return config


def published_glm5_2_config() -> dict[str, Any]:
    """GLM-5.2's published config.json as a dict (a fresh copy: callers may change it)."""
    return copy.deepcopy(_published_glm5_2())


def complete(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with transformers' GlmMoeDsaConfig defaults for the keys it leaves out."""
    from transformers import AutoConfig

    return AutoConfig.for_model(MODEL_TYPE, **{k: v for k, v in config.items() if k != "model_type"}).to_dict()


def variant_config(variant: str) -> dict[str, Any]:
    if variant == names.GLM5_2:
        return complete(published_glm5_2_config())
    if variant == names.GLM5:
        return complete({})
    raise ValueError(f"GLM-5 family: no variant {variant!r}; known: {names.GLM5!r}, {names.GLM5_2!r}")


def describe(variant: str) -> str:
    if variant == names.GLM5_2:
        return "GLM-5.2's published architecture (21 full / 57 shared DSA layers, RoPE theta 8e6, fp32 router)"
    return "GLM-5's shape from transformers' GlmMoeDsaConfig (every DSA layer full)"


GLM5_FAMILY = family.register(
    family.ModelFamily(
        name="glm5",
        model_type=MODEL_TYPE,
        named_as=names.named_as,
        named_in=names.named_in,
        variant_config=variant_config,
        describe=describe,
        complete=complete,
        indexer_kinds=indexer_types,
        megatron_fields=glm5_config_fields,
        first_dense_layers=3,  # GlmMoeDsaConfig's first_k_dense_replace
    )
)
