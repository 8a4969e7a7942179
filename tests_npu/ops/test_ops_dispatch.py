"""verl_npu.ops.dispatch: backend choice per device, the Triton RMSNorm under the interpreter, the Ascend adapter."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest
import torch

from verl_npu.ops import ascend, dispatch


def test_cpu_tensors_get_the_portable_backend_and_forcing_a_missing_one_fails_loudly(monkeypatch):
    monkeypatch.delenv("VERL_NPU_OPS_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert dispatch.backend_for("rms_norm", cpu) == "portable"
    assert dispatch.backend_for("dsa_sparse_attention", cpu) == "portable"
    monkeypatch.setenv("VERL_NPU_OPS_BACKEND", "ascend")
    with pytest.raises(RuntimeError, match="op rms_norm has no ascend kernel for cpu tensors"):
        dispatch.backend_for("rms_norm", cpu)
    assert dispatch.backend_for("hadamard_transform", cpu) == "portable"  # it has no ascend kernel: as usual
    monkeypatch.setenv("VERL_NPU_OPS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="VERL_NPU_OPS_BACKEND='cuda': choose one of ascend, triton, portable"):
        dispatch.backend_for("rms_norm", cpu)
    with pytest.raises(ValueError, match="unknown op 'layer_norm'"):
        dispatch.backend_for("layer_norm", cpu)


def test_portable_rms_norm_with_residual_returns_the_sum_and_its_norm():
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.rand(8) + 0.5
    y, h = dispatch.rms_norm(x, w, 1e-6, residual=r)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, (x + r) * torch.rsqrt((x + r).pow(2).mean(-1, keepdim=True) + 1e-6) * w)


def test_the_ascend_adapter_casts_gamma_and_adds_the_residual(monkeypatch):
    calls = []

    def npu_rms_norm(x, gamma, epsilon=1e-6):
        """Stands in for torch_npu.npu_rms_norm: same signature; returns (y, rstd); gamma must be x's dtype."""
        assert gamma.dtype == x.dtype, "torch_npu requires gamma in x's dtype"
        calls.append(epsilon)
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
        return (x.float() * rstd * gamma.float()).to(x.dtype), rstd

    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_rms_norm=npu_rms_norm))
    x, r = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.rand(16) + 0.5  # fp32 parameter, bf16 activations: the adapter casts
    y, h = ascend.rms_norm(x, w, 1e-5, r)
    assert calls == [1e-5] and torch.equal(h, x + r)
    torch.testing.assert_close(y, dispatch.rms_norm(x + r, w.to(torch.bfloat16), 1e-5))


TRITON_PARITY = textwrap.dedent(
    """
    import torch
    from verl_npu.ops import ascend, dispatch
    from verl_npu.ops.rmsnorm import rms_norm
    assert dispatch.backend_for("rms_norm", torch.device("cpu")) == "triton"
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for rows, cols, residual in ((5, 37, True), (3, 64, False), (1, 1000, True)):
            x = torch.randn(rows, cols, dtype=dtype, requires_grad=True)
            w = (torch.rand(cols) + 0.5).to(dtype).requires_grad_()
            r = torch.randn(rows, cols, dtype=dtype, requires_grad=True) if residual else None
            out = dispatch.rms_norm(x, w, 1e-6, residual=r)
            y, h = out if residual else (out, None)
            gy = torch.randn_like(y)
            (y * gy).float().sum().backward() if h is None else ((y * gy).float().sum() + h.float().sum()).backward()
            grads = [t.grad.float() for t in (x, w, r) if t is not None]
            leaves = [t.detach().float().requires_grad_() for t in (x, w, r) if t is not None]
            x32, w32 = leaves[0], leaves[1]
            h32 = x32 + leaves[2] if residual else x32
            y32 = rms_norm(h32, w32, 1e-6)
            ((y32 * gy.float()).sum() + (h32.sum() if residual else 0)).backward()
            torch.testing.assert_close(y.float(), y32, atol=tol, rtol=tol)
            for mine, ref in zip(grads, leaves):
                scale = ref.grad.abs().max().clamp(min=1)
                torch.testing.assert_close(mine / scale, ref.grad / scale, atol=tol, rtol=tol)
    print("ok")
    """
)


def test_triton_rms_norm_forward_and_backward_match_the_fp32_reference_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA torch)")
    done = subprocess.run(
        [sys.executable, "-c", TRITON_PARITY],
        capture_output=True, text=True, timeout=600, check=False,
        env={**__import__("os").environ, "TRITON_INTERPRET": "1", "VERL_NPU_OPS_BACKEND": "triton"},
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr[-3000:]


def test_hadamard_is_dispatched_and_megatrons_dsa_rotation_goes_through_the_dispatcher(monkeypatch):
    from verl_npu.ops.hadamard import hadamard_matrix
    from verl_npu.runtime_patches import dsa_indexer_rotation

    monkeypatch.delenv("VERL_NPU_OPS_BACKEND", raising=False)
    x = torch.randn(3, 64)
    assert dispatch.backend_for("hadamard_transform", x.device) == "portable"
    torch.testing.assert_close(dispatch.hadamard_transform(x, 0.125), (x @ hadamard_matrix(64).T) * 0.125)
    seen = []
    monkeypatch.setattr(dispatch, "hadamard_transform", lambda t, scale: seen.append((t.shape, scale)) or t)
    rotate = dsa_indexer_rotation.PATCH.build(None)  # what the patch puts in place of megatron's rotate_activation
    rotate(torch.ones(2, 16, dtype=torch.bfloat16))
    assert seen == [((2, 16), 0.25)]


def test_dsa_attention_on_triton_picks_the_kernel_by_key_heads_and_head_dim(monkeypatch, caplog):
    """Routing only (the kernels' numerics have their own tests): gather kernel for one shared key head,
    tiled kernel for per-head keys up to head dim 256, portable beyond (logged; an error when forced)."""
    from verl_npu.ops import dsa_attention, dsa_attention_mqa_triton, dsa_attention_triton

    calls = []
    for module, name in (
        (dsa_attention_mqa_triton, "sparse_attention_mqa_triton"),
        (dsa_attention_triton, "sparse_attention_triton"),
        (dsa_attention, "sparse_attention"),
    ):
        monkeypatch.setattr(module, name, lambda *args, _name=name: calls.append(_name) or "out")
    monkeypatch.delenv("VERL_NPU_OPS_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # makes the triton backend usable for CPU tensors
    monkeypatch.setattr(dispatch, "_FALLBACKS_LOGGED", set())
    idx = torch.zeros(1, 4, 2, dtype=torch.long)

    def attend(heads, kv_heads, hn, hnv, dtype=torch.float32):
        q = torch.zeros(4, 1, heads, hn, dtype=dtype)
        k, v = torch.zeros(4, 1, kv_heads, hn, dtype=dtype), torch.zeros(4, 1, kv_heads, hnv, dtype=dtype)
        return dispatch.dsa_sparse_attention(q, k, v, idx, 1.0)

    attend(8, 1, 576, 512)
    attend(8, 8, 256, 256)
    with caplog.at_level("WARNING", logger="verl_npu.ops.dispatch"):
        attend(8, 8, 320, 256)
        attend(8, 1, 64, 64, dtype=torch.float64)
    assert calls == ["sparse_attention_mqa_triton", "sparse_attention_triton", "sparse_attention", "sparse_attention"]
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:  # verl's deterministic mode: the gather kernel's atomics are not repeatable, so portable runs (logged)
        with caplog.at_level("WARNING", logger="verl_npu.ops.dispatch"):
            attend(8, 1, 576, 512)
            attend(8, 8, 256, 256)  # the tiled kernel has no atomics: it stays
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert calls[4:] == ["sparse_attention", "sparse_attention_triton"]
    assert "torch.use_deterministic_algorithms(True): the one-key-head Triton kernel's backward" in caplog.text
    assert "head dims 320/256: the tiled Triton kernel is built for head dims up to 256" in caplog.text
    assert "dtypes torch.float64/torch.float64/torch.float64: the Triton kernels take one of bf16" in caplog.text
    monkeypatch.setenv("VERL_NPU_OPS_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="VERL_NPU_OPS_BACKEND=triton: dsa_sparse_attention: per-head keys"):
        attend(8, 8, 320, 256)
