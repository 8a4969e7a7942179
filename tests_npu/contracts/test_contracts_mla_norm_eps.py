"""The rollout's MLA latent norms use the config's rms_norm_eps: the two contracts that pin it (vLLM's
DeepseekV2MLAAttention.__init__ and vllm-ascend's replacement of it) hold on the pinned sdists and fail, naming the
fact with what was expected, on a copy whose eps was changed to transformers' hard-coded 1e-6
(docs/parity.md, "The MLA latent norms' epsilon")."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from verl_npu import contracts
from verl_npu.contracts.verify import DRIFTED, OK, verify

# (contract, file, the pinned text, the drifted text, the fact the verification must name)
LATENT_NORM_DRIFTS = (
    ("vllm-mla-latent-norms-use-rms-norm-eps", "vllm/model_executor/models/deepseek_v2.py",
     "self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)",
     "self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=1e-6)", "kv latent: rms_norm_eps"),
    ("vllm-mla-latent-norms-use-rms-norm-eps", "vllm/model_executor/models/deepseek_v2.py",
     "self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)",
     "self.q_a_layernorm = RMSNorm(self.q_lora_rank)", "q latent: rms_norm_eps"),
    ("vllm-ascend-mla-latent-norms-use-rms-norm-eps", "vllm_ascend/patch/worker/patch_deepseek_v2.py",
     "        self.kv_lora_rank,\n        eps=config.rms_norm_eps,", "        self.kv_lora_rank,\n        eps=1e-6,",
     "kv latent: rms_norm_eps"),
    ("vllm-ascend-mla-latent-norms-use-rms-norm-eps", "vllm_ascend/patch/worker/patch_deepseek_v2.py",
     "            self.q_lora_rank,\n            eps=config.rms_norm_eps,", "            self.q_lora_rank,\n",
     "q latent: rms_norm_eps"),
)  # fmt: skip
CONTRACT_IDS = sorted({case[0] for case in LATENT_NORM_DRIFTS})


def test_both_rollout_components_pin_the_latent_norms_eps():
    pinned = {c.id: c for c in contracts.ALL if c.id in CONTRACT_IDS}
    assert sorted(pinned) == CONTRACT_IDS
    assert {c.component for c in pinned.values()} == {"vllm", "vllm-ascend"}
    for contract in pinned.values():
        assert "rms_norm_eps" in contract.relied_on and "verl_npu/parity/independent.py" in contract.used_by
        assert {e.fact for e in contract.expects} == {"q latent: rms_norm_eps", "kv latent: rms_norm_eps"}


@pytest.fixture(scope="module")
def pinned_sources(tmp_path_factory) -> dict[str, Path]:
    """The files these contracts read, from the vLLM and vllm-ascend sdists the stack pins."""
    from support.pypi import contract_sources

    return contract_sources(CONTRACT_IDS, tmp_path_factory.mktemp)


@pytest.mark.network
@pytest.mark.parametrize("case", LATENT_NORM_DRIFTS, ids=[f"{c[0]}:{c[4]}" for c in LATENT_NORM_DRIFTS])
def test_a_latent_norm_eps_changed_upstream_fails_its_contract(case, pinned_sources, tmp_path):
    contract_id, path, text, replacement, fact = case
    contract = contracts.by_id(contract_id)
    pinned = pinned_sources[contract.component]
    (held,) = verify([contract], {contract.component: pinned})
    assert held.status == OK, held.detail
    drifted = tmp_path / contract.component
    shutil.copytree(pinned, drifted)
    source = (drifted / path).read_text()
    # vLLM's non-MLA DeepseekV2Attention builds its kv norm the same way: every copy is changed
    assert source.count(text) >= 1, f"{path} no longer has {text!r}: update the drift case"
    (drifted / path).write_text(source.replace(text, replacement))
    (result,) = verify([contract], {contract.component: drifted})
    assert result.status == DRIFTED, result.detail
    # the fact, and the text expected that the drifted source no longer holds
    expect = next(e for e in contract.expects if e.fact == fact)
    assert f"{fact}: {expect.broken()}" in result.detail, result.detail
