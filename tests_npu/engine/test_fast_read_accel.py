"""The HF load's device copies on a real accelerator (accel tier: CUDA or an NPU): tensors read from a safetensors
checkpoint reach the device bit for bit, from the copy threads, in any order the load takes them
(verl_npu/engine/bridges/fast_read.py, ``TensorReads`` with a device)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("mbridge", reason="the bridges' reader; not installed here")

from safetensors.torch import save_file

from verl_npu.engine.bridges import fast_read

pytestmark = pytest.mark.accel


@pytest.fixture(scope="module")
def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.device_count() - 1)  # not the copy threads' default device 0 where >1
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.device("npu", torch.npu.device_count() - 1)


def test_device_copies_bring_every_tensor_to_the_device_bit_for_bit(tmp_path, monkeypatch, device):
    from mbridge.core.safetensor_io import SafeTensorIO

    g = torch.Generator().manual_seed(11)
    tensors = {
        "w": torch.randn(256, 512, generator=g).to(torch.bfloat16),
        "fp8": torch.randn(128, 128, generator=g).to(torch.float8_e4m3fn),
        "scale": torch.rand(1, 1, generator=g),
        "ids": torch.arange(1000, dtype=torch.int64),
    }
    save_file(tensors, str(tmp_path / "m.safetensors"))
    monkeypatch.setattr(fast_read, "COPY_AHEAD_BYTES", 64 << 10)  # the copies wait for room, one at a time
    order = ["ids", "w", "fp8", "scale"]
    with fast_read.TensorReads(SafeTensorIO(str(tmp_path)), order, {"w": 2}, device) as loaded:
        got = {name: loaded.take(name) for name in reversed(order)}
        again = loaded.take("w")
    for name, tensor in tensors.items():
        assert got[name].device == device and got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name].cpu().view(torch.uint8), tensor.view(torch.uint8)), name
    assert again.data_ptr() == got["w"].data_ptr()  # the second take: the same device copy, not another
