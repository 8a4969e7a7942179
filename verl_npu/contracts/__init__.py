"""Contracts with the upstreams: facts verl-npu relies on in MindSpeed, vllm-ascend, torch-npu and vLLM.

Each fact is recorded with the upstream file and symbol, a sha256 of that symbol's source at the
pinned version and expectations that state it in words (docs/ascend_contracts.md lists them all).
Three places check them: the CPU tests (our side against the recorded facts), the image build and
``verl-npu doctor`` on a node (``verl-npu contracts verify`` against the installed sources), and the
network-tier tests (the torch-npu wheel and the vllm-ascend and vLLM sdists from PyPI). An upstream upgrade then
fails a test or an image build, not a 512-NPU job.
"""

from __future__ import annotations

from verl_npu.contracts import mindspeed, torch_npu, vllm, vllm_ascend
from verl_npu.contracts.spec import COMPONENTS, Contract, Expect

ALL: tuple[Contract, ...] = (*mindspeed.CONTRACTS, *vllm_ascend.CONTRACTS, *torch_npu.CONTRACTS, *vllm.CONTRACTS)
# verl 0.9.1's GLM-5.2 rollout patch (VERL_VLLM_ASCEND_GLM52_PATCH): every vllm-ascend / vLLM object it reads,
# replaces or imports, as verl names it -> the ids of the contracts that record what it checks there.
VERL_GLM52_PATCH_TARGETS: dict[str, tuple[str, ...]] = {
    **vllm_ascend.VERL_GLM52_PATCH_TARGETS,
    **vllm.VERL_GLM52_PATCH_TARGETS,
}


def by_id(contract_id: str) -> Contract:
    for contract in ALL:
        if contract.id == contract_id:
            return contract
    raise KeyError(f"no contract {contract_id!r}; ids: {', '.join(c.id for c in ALL)}")


__all__ = ["ALL", "COMPONENTS", "VERL_GLM52_PATCH_TARGETS", "Contract", "Expect", "by_id"]
