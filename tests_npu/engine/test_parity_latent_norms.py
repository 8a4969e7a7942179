"""The engine's MLA latent norms (megatron's q_layernorm / kv_layernorm) are built with the config's rms_norm_eps, as
vLLM's rollout builds q_a_layernorm / kv_a_layernorm (contracts vllm-mla-latent-norms-use-rms-norm-eps and
vllm-ascend-mla-latent-norms-use-rms-norm-eps; docs/parity.md), on the parity model's own checkpoint."""

from __future__ import annotations

import pytest
from test_glm5_bridge import cpu_engine, gpt_of, no_hadamard_shim_afterwards, select_npu_engine  # noqa: F401

pytestmark = pytest.mark.usefixtures("cpu_megatron_harness")


@pytest.fixture(scope="module", params=[None, 3e-5], ids=["published", "rms_norm_eps=3e-5"])
def parity_glm5_2(request, tmp_path_factory):
    """The parity glm5_2 checkpoint with a word-level tokenizer (verl's model config loads one); its config's
    rms_norm_eps as published, or changed (the built norms must follow the config, not a constant)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from verl_npu.parity.models import MODELS, write_checkpoint

    model = MODELS["glm5_2"]
    path = write_checkpoint(model, tmp_path_factory.mktemp("parity_glm5_2"))
    vocab = {f"t{i}": i for i in range(model.config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t1").save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-5  # GLM-5.2's published value (examples/glm5_2/config.json)
    if request.param is not None:
        config["rms_norm_eps"] = request.param
        (path / "config.json").write_text(json.dumps(config))
    return config, path


def _eps(norm) -> float:
    for name in ("eps", "variance_epsilon", "epsilon"):
        if isinstance(getattr(norm, name, None), float):
            return getattr(norm, name)
    raise AssertionError(f"{type(norm).__name__} holds no eps attribute: {sorted(vars(norm))}")


def test_the_engines_latent_norms_use_rms_norm_eps(parity_glm5_2):
    config, path = parity_glm5_2
    layers = gpt_of(cpu_engine(path)).decoder.layers
    eps = config["rms_norm_eps"]
    found = {(n, which): _eps(getattr(layer.self_attention, which)) for n, layer in enumerate(layers)
             for which in ("q_layernorm", "kv_layernorm")}  # fmt: skip
    assert len(found) == 2 * config["num_hidden_layers"]
    assert set(found.values()) == {eps}, found
