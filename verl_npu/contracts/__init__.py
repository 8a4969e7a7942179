"""Contracts with the Ascend upstreams: facts verl-npu relies on in MindSpeed, vllm-ascend and torch-npu.

Each fact is recorded with the upstream file and symbol, a sha256 of that symbol's source at the
pinned version and expectations that state it in words (docs/ascend_contracts.md lists them all).
Three places check them: the CPU tests (our side against the recorded facts), the image build and
``verl-npu doctor`` on a node (``verl-npu contracts verify`` against the installed sources), and the
network-tier tests (the torch-npu wheel and vllm-ascend sdist from PyPI). An upstream upgrade then
fails a test or an image build, not a 512-NPU job.
"""

from __future__ import annotations

from verl_npu.contracts import mindspeed, torch_npu, vllm_ascend
from verl_npu.contracts.spec import COMPONENTS, Contract, Expect

ALL: tuple[Contract, ...] = (*mindspeed.CONTRACTS, *vllm_ascend.CONTRACTS, *torch_npu.CONTRACTS)


def by_id(contract_id: str) -> Contract:
    for contract in ALL:
        if contract.id == contract_id:
            return contract
    raise KeyError(f"no contract {contract_id!r}; ids: {', '.join(c.id for c in ALL)}")


__all__ = ["ALL", "COMPONENTS", "Contract", "Expect", "by_id"]
