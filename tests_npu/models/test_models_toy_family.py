"""A second DSA model family, defined here and registered, reaches preflight, the engine's build plan and the name
lookup with no change outside verl_npu/models/ (the registry, verl_npu/models/family.py).

The toy family is test-only: its own model_type, names, defaults, indexer rule (a full DSA indexer on every
``indexer_every``-th layer, shared layers between) and megatron mapping. Nothing in verl_npu knows it; each test
sees it registered by the fixture and gone afterwards.
"""

from __future__ import annotations

import re
import types

import pytest

from verl_npu.checks import FAIL, OK, WARN
from verl_npu.models import family as model_family
from verl_npu.models.family import FULL, SHARED, FamilyRegistryError, ModelFamily

TOY_TYPE = "toy_dsa"
TOY_NAME = re.compile(r"toy-?dsa", re.IGNORECASE)
TOY_DEFAULTS = dict(
    model_type=TOY_TYPE,
    vocab_size=1024,
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=512,
    moe_intermediate_size=128,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=16,
    indexer_every=3,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def toy_kinds(hf_config) -> tuple[str, ...]:
    every = getattr(hf_config, "indexer_every", 1)
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"toy bridge: indexer_every must be a positive integer, got {every!r}")
    return tuple(FULL if i % every == 0 else SHARED for i in range(hf_config.num_hidden_layers))


def toy_megatron_fields(hf_config) -> dict:
    if hf_config.q_lora_rank is None:
        raise NotImplementedError("toy bridge: the indexer reads the q low-rank input; q_lora_rank is None")
    toy_kinds(hf_config)
    return {"experimental_attention_variant": "dsa", "dsa_indexer_topk": hf_config.index_topk}


TOY = ModelFamily(
    name="toy",
    model_type=TOY_TYPE,
    named_as=lambda text: "toy-dsa" if TOY_NAME.fullmatch(text) else None,
    named_in=lambda text: "toy-dsa" if TOY_NAME.search(text) else None,
    variant_config=lambda variant: dict(TOY_DEFAULTS),
    describe=lambda variant: "the toy DSA family's defaults",
    complete=lambda config: {**TOY_DEFAULTS, **config},
    indexer_kinds=toy_kinds,
    megatron_fields=toy_megatron_fields,
    first_dense_layers=1,
)
TOY_LAYOUT = (FULL, SHARED, SHARED, FULL, SHARED, SHARED, FULL, SHARED)  # indexer_every=3 over 8 layers


@pytest.fixture
def toy():
    model_family.register(TOY)
    yield TOY
    model_family.unregister(TOY.name)


def test_a_registered_family_is_found_by_model_type_and_by_name(toy):
    assert model_family.family_of(TOY_TYPE) is toy
    assert model_family.named_as("toy-dsa") == (toy, "toy-dsa")
    assert model_family.named_in("/models/Toy-DSA-7B") == (toy, "toy-dsa")
    assert model_family.named_as("glm5_2")[0].name == "glm5"  # the built-in family is still found


def test_preflight_reads_the_toy_models_shape_through_its_family(toy):
    from verl_npu.preflight.model_shape import ModelShape, load_config

    config = load_config("toy-dsa")
    assert config == TOY_DEFAULTS
    shape = ModelShape.from_hf(config)
    assert shape.index_share and shape.dsa and shape.mla
    assert shape.indexer_full == tuple(kind == FULL for kind in TOY_LAYOUT)
    # a config that leaves first_k_dense_replace out takes the family's default (one dense layer)
    assert shape.is_moe == (False,) + (True,) * 7
    # the family's defaults complete a config.json that sets only what differs
    written = ModelShape.from_hf({"model_type": TOY_TYPE, "num_hidden_layers": 4, "indexer_every": 2})
    assert written.num_layers == 4 and written.indexer_full == (True, False, True, False)


def test_preflight_resolves_a_toy_model_path_that_is_not_on_this_machine(toy):
    from verl_npu.preflight.model import FROM_NAME, resolve_model

    config, check, origin = resolve_model("/models/Toy-DSA-7B", None)
    assert origin == FROM_NAME and check.status == WARN and "the toy DSA family's defaults" in check.detail
    assert config == TOY_DEFAULTS


def test_the_engine_checks_and_build_plan_read_the_toy_familys_layout(toy):
    from verl_npu.engine.build_plan import index_share_kinds
    from verl_npu.preflight.engine_checks import model_bridge_checks

    assert index_share_kinds(TOY_DEFAULTS) == TOY_LAYOUT
    checks = model_bridge_checks(TOY_DEFAULTS)
    assert [c.status for c in checks] == [OK]
    assert "toy_dsa: verl-npu's toy bridge" in checks[0].detail and "3 full / 5 shared" in checks[0].detail
    assert "full 0, 3, 6" in checks[0].detail
    (refused,) = model_bridge_checks({**TOY_DEFAULTS, "q_lora_rank": None})
    assert refused.status == FAIL and "q_lora_rank is None" in refused.detail


def test_the_build_plan_runs_the_toy_model_through_index_share(toy):
    pytest.importorskip("verl", reason="the build plan reads verl's engine config dataclasses; verl is not installed")
    from verl.workers.config import McoreEngineConfig, McoreOptimizerConfig

    from verl_npu.engine.build_plan import build_plan

    engine = McoreEngineConfig(use_remove_padding=False, vanilla_mbridge=True, pipeline_model_parallel_size=2)
    plan = build_plan(engine, McoreOptimizerConfig(lr=1e-6), types.SimpleNamespace(**TOY_DEFAULTS), "cuda")
    assert "dsa_index_share" in plan.features
    (note,) = [n for n in plan.notes if n.startswith("IndexShare")]
    assert "3 full / 5 shared" in note


def test_without_registration_nothing_knows_the_toy_family():
    from verl_npu.engine.build_plan import index_share_kinds
    from verl_npu.preflight.engine_checks import model_bridge_checks
    from verl_npu.preflight.model_shape import ModelShape

    assert model_family.family_of(TOY_TYPE) is None and model_family.named_as("toy-dsa") is None
    assert index_share_kinds(TOY_DEFAULTS) is None and model_bridge_checks(TOY_DEFAULTS) == []
    assert not ModelShape.from_hf(TOY_DEFAULTS).index_share


def test_a_family_claiming_a_registered_model_type_is_refused():
    glm5 = model_family.family_of("glm_moe_dsa")
    clash = ModelFamily(**{**vars(TOY), "model_type": glm5.model_type})
    with pytest.raises(FamilyRegistryError, match=r"'toy'.*glm_moe_dsa.*clashes with the registered 'glm5'"):
        model_family.register(clash)
    assert model_family.family_of("glm_moe_dsa") is glm5
    model_family.register(glm5)  # the same family again: a no-op
    assert model_family.families().count(glm5) == 1
