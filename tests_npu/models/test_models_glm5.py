"""GLM-5's family facts in one place (verl_npu/models/glm5/): GLM-5.2's indexer layout agrees with the published
config (examples/glm5_2/config.json), which the package ships and preflight reads for a GLM-5.2 name, and every way of
naming the family resolves to the same config."""

from __future__ import annotations

import json

import pytest
from support.paths import REPO

from verl_npu.models.glm5 import family, names
from verl_npu.models.glm5.config import glm5_2_indexer_types
from verl_npu.preflight.model_shape import load_config

EXAMPLE_CONFIG = REPO / "examples" / "glm5_2" / "config.json"
PUBLISHED = json.loads(EXAMPLE_CONFIG.read_text())


def test_the_indexer_rule_is_the_published_layout():
    assert glm5_2_indexer_types(PUBLISHED["num_hidden_layers"]) == PUBLISHED["indexer_types"]
    assert glm5_2_indexer_types(78).count("full") == 21
    assert glm5_2_indexer_types(8) == ["full"] * 3 + ["shared"] * 3 + ["full", "shared"]


def test_the_package_ships_the_examples_published_config():
    assert family.published_glm5_2_config() == PUBLISHED
    assert load_config("glm5.2") == load_config(str(EXAMPLE_CONFIG))  # the name and the example's file are one config


def test_a_published_config_that_is_not_glm5_is_refused_as_a_broken_install(monkeypatch, tmp_path):
    damaged = tmp_path / family.PUBLISHED_GLM5_2
    damaged.write_text('{"model_type": "llama"}')
    monkeypatch.setattr(family.importlib.resources, "files", lambda package: tmp_path)
    family._published_glm5_2.cache_clear()
    try:
        with pytest.raises(family.PublishedConfigError, match=r"not a glm_moe_dsa config\.json; reinstall verl-npu"):
            family.published_glm5_2_config()
        damaged.write_text("{not json")
        with pytest.raises(family.PublishedConfigError, match="cannot be read"):
            family.published_glm5_2_config()
    finally:
        family._published_glm5_2.cache_clear()


@pytest.mark.parametrize(
    ("text", "as_value", "in_path"),
    [
        ("glm5", names.GLM5, names.GLM5),
        ("GLM-5", names.GLM5, names.GLM5),
        ("glm5.2", names.GLM5_2, names.GLM5_2),
        ("glm5_2", names.GLM5_2, names.GLM5_2),
        ("GLM-5-2", names.GLM5_2, names.GLM5_2),
        ("glm52", names.GLM5_2, names.GLM5_2),
        ("GLM-5.2-FP8", None, names.GLM5_2),
        ("glm5.25", None, names.GLM5),  # not 5.2: a 5.25 names GLM-5's family only
        ("qwen2.5", None, None),
    ],
)
def test_every_name_of_the_family_is_read_alike(text, as_value, in_path):
    assert names.named_as(text) == as_value and names.named_in(text) == in_path


def test_a_model_config_given_by_any_glm5_2_name_is_the_published_architecture():
    # --model-config glm5_2 once fell through to a hub lookup while a model path named glm5_2 was recognised
    configs = [load_config(name) for name in ("glm5.2", "glm5_2", "GLM-5-2")]
    assert all(config == configs[0] for config in configs)
    assert configs[0]["indexer_types"] == PUBLISHED["indexer_types"]
    assert set(load_config("glm5")["indexer_types"]) == {"full"}  # GLM-5: every layer computes its top-k
