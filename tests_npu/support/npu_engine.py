"""Fixtures for test modules that build models through verl's engine with verl-npu's engine selected.

A test module takes them by importing them (``from support.npu_engine import no_hadamard_shim_afterwards,
select_npu_engine``): both are module-scoped and autouse, so importing them puts them around that module's tests.
"""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(scope="module", autouse=True)
def select_npu_engine():
    import verl_npu.megatron_adaptor as layer

    with pytest.MonkeyPatch.context() as env:
        env.setenv("VERL_ENGINE_DEVICE", "npu")
        env.setenv("VERL_ENGINE_VENDOR", "huawei")
        layer.load()
        yield


@pytest.fixture(scope="module", autouse=True)
def no_hadamard_shim_afterwards():
    """verl's model build installs a pure-torch ``fast_hadamard_transform`` module and binds it into every
    module that imported the missing extension as None (verl/models/mcore/patch.py); later tests of this
    process expect the machine as it is (without the extension)."""
    shim_before = sys.modules.get("fast_hadamard_transform")
    yield
    from verl.models.mcore.patch import pure_torch_hadamard_transform

    if shim_before is not None or sys.modules.get("fast_hadamard_transform") is None:
        return
    del sys.modules["fast_hadamard_transform"]
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if namespace is not None and namespace.get("hadamard_transform") is pure_torch_hadamard_transform:
            namespace["hadamard_transform"] = None
