"""Test tiers: default (CPU), `accel` (CUDA or NPU), `npu` (Ascend), `network` (PyPI)."""

from __future__ import annotations

import functools
import importlib.util
import socket
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# tests_npu/ is on sys.path through pyproject's pythonpath: `from support import ...` from every folder


@functools.cache
def _accelerator() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if torch.cuda.is_available():
        return "cuda"
    try:
        import torch_npu  # noqa: F401  (any failure means: no usable NPU here)
    except Exception:
        return None
    return "npu" if torch.npu.is_available() else None


@functools.cache
def pypi_reachable() -> bool:
    try:
        with socket.create_connection(("pypi.org", 443), timeout=5):
            return True
    except OSError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("npu") and _accelerator() != "npu":
            item.add_marker(pytest.mark.skip(reason="needs an Ascend NPU with torch_npu and CANN (npu tier)"))
        elif item.get_closest_marker("accel") and _accelerator() is None:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU or an Ascend NPU (accel tier)"))
        if item.get_closest_marker("network") and not pypi_reachable():
            item.add_marker(pytest.mark.skip(reason="PyPI is not reachable from this machine (network tier)"))


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="module")
def cpu_megatron_harness():
    """megatron's CUDA calls redirected to the CPU for one test module (verl_npu/testing/cpu_megatron.py)."""
    from verl_npu.testing import cpu_megatron

    cpu_megatron.activate()
    cpu_megatron.init_model_parallel()
    yield cpu_megatron
    cpu_megatron.deactivate()


@pytest.fixture(scope="session", autouse=True)
def preflight_cache(tmp_path_factory):
    """Preflight's answer cache in a per-session directory: tests neither read nor fill ~/.cache."""
    import os

    path = tmp_path_factory.mktemp("verl-npu-cache")
    saved = os.environ.get("VERL_NPU_CACHE_DIR")
    os.environ["VERL_NPU_CACHE_DIR"] = str(path)
    yield path
    if saved is None:
        os.environ.pop("VERL_NPU_CACHE_DIR", None)
    else:
        os.environ["VERL_NPU_CACHE_DIR"] = saved


@pytest.fixture(scope="session")
def parity_runs(tmp_path_factory):
    """The CPU parity runs of the session, each made once (tests_npu/support/parity_runs.py)."""
    from support.parity_runs import ParityRuns

    return ParityRuns(tmp_path_factory.mktemp("parity-runs"))
