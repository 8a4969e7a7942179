"""A model family as the rest of verl-npu sees it, and the registry that finds one by HF ``model_type`` or by name.

A family with DeepSeek sparse attention (DSA) says how a model is named, what its published configs are, how its HF
config is completed with the family's defaults, which layers compute their own DSA top-k ("full") and which reuse the
most recent full layer's ("shared", IndexShare), and how its HF config maps onto megatron-core's TransformerConfig.
Preflight (``verl_npu.preflight``), the engine's build plan and parity read a family only through
:func:`family_of` / :func:`named_as` / :func:`named_in`, so that a new family is one folder under ``verl_npu/models/``
plus its :func:`register` call (CONTRIBUTING.md, "Add a model family"). Torch-free: preflight imports this in its
parent process.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

FULL, SHARED = "full", "shared"

# the families verl-npu ships, registered on first lookup (their modules import this one)
BUILT_IN = ("verl_npu.models.glm5.family",)


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str  # "glm5"
    model_type: str  # the HF config's model_type ("glm_moe_dsa")
    # a whole --model-config value -> the variant it names ("glm5.2"), else None
    named_as: Callable[[str], str | None]
    # a model path -> the variant it names, else None (a search: "/models/GLM-5.2-FP8" names "glm5.2")
    named_in: Callable[[str], str | None]
    # variant -> its complete HF config as a dict (published, or the family's defaults)
    variant_config: Callable[[str], dict[str, Any]]
    # variant -> one line saying what that config is, for preflight's "not on this machine" warning
    describe: Callable[[str], str]
    # an HF config dict -> the same completed with the family's defaults (ValueError / TypeError: refused)
    complete: Callable[[dict[str, Any]], dict[str, Any]]
    # an HF config read as attributes -> "full" / "shared" per layer; ValueError for a list the engine cannot build
    indexer_kinds: Callable[[Any], tuple[str, ...]]
    # an HF config read as attributes -> the TransformerConfig fields the engine's bridge builds it with;
    # NotImplementedError / ValueError for a config the bridge refuses
    megatron_fields: Callable[[Any], dict[str, Any]]
    # first_k_dense_replace where the config leaves it out
    first_dense_layers: int = 0


class FamilyRegistryError(ValueError):
    """A family registered twice under different definitions, or two families claiming one model_type or name."""


_FAMILIES: dict[str, ModelFamily] = {}
_LOCK = threading.Lock()
_BUILT_IN_LOADED = False


def register(family: ModelFamily) -> ModelFamily:
    """Add ``family``; idempotent for the same object, FamilyRegistryError where its name or model_type is taken."""
    with _LOCK:
        for other in _FAMILIES.values():
            if other is family:
                return family
            if family.name == other.name or family.model_type == other.model_type:
                raise FamilyRegistryError(
                    f"model family {family.name!r} (model_type {family.model_type!r}) clashes with the registered "
                    f"{other.name!r} (model_type {other.model_type!r}); unregister that one first or rename yours"
                )
        _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    with _LOCK:
        _FAMILIES.pop(name, None)


def families() -> tuple[ModelFamily, ...]:
    _load_built_in()
    return tuple(_FAMILIES.values())


def family_of(model_type: Any) -> ModelFamily | None:
    """The registered family of an HF ``model_type``, else None (a model verl-npu builds through mbridge alone)."""
    return next((family for family in families() if family.model_type == model_type), None)


def named_as(text: str) -> tuple[ModelFamily, str] | None:
    """The family and variant a whole ``--model-config`` value names ("glm5_2"), else None."""
    return _first_named(text, lambda family: family.named_as)


def named_in(text: str) -> tuple[ModelFamily, str] | None:
    """The family and variant a model path names ("/models/GLM-5.2-FP8"), else None."""
    return _first_named(text, lambda family: family.named_in)


def _first_named(
    text: str, rule: Callable[[ModelFamily], Callable[[str], str | None]]
) -> tuple[ModelFamily, str] | None:
    for family in families():
        variant = rule(family)(text)
        if variant is not None:
            return family, variant
    return None


def layer_kinds(hf_config: Mapping[str, Any] | Any) -> tuple[str, ...] | None:
    """Each layer's indexer ("full" / "shared") for a model of a registered DSA family, else None."""
    model_type = (
        hf_config.get("model_type") if isinstance(hf_config, Mapping) else getattr(hf_config, "model_type", None)
    )
    family = family_of(model_type)
    return None if family is None else family.indexer_kinds(as_attributes(hf_config))


def as_attributes(hf_config: Any) -> Any:
    """A config dict (preflight's) read as attributes, the way the engine's PretrainedConfig is."""
    import types

    return types.SimpleNamespace(**hf_config) if isinstance(hf_config, Mapping) else hf_config


def _load_built_in() -> None:
    global _BUILT_IN_LOADED
    if _BUILT_IN_LOADED:
        return
    import importlib

    for module in BUILT_IN:
        importlib.import_module(module)  # each registers its family
    _BUILT_IN_LOADED = True
