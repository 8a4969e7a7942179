"""What verl-npu's Triton kernels share on the host side (importing it does not import Triton)."""

from __future__ import annotations

import os

import torch

TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def interpreted() -> bool:
    """The kernels' INTERPRETED switch (``TRITON_INTERPRET=1``: the interpreter runs them on CPU, in tests).

    Under it the kernels take two work-arounds for Triton 3.6's interpreter, no change in the maths.
    Tile loops: compiled, a ``for`` loop over a loaded tile count is what the compiler software-
    pipelines; the interpreter cannot take a loaded scalar as a ``range`` bound under numpy 2 (it
    calls ``int()`` on a one-element array) but evaluates a ``while`` condition. Products: the
    interpreter multiplies bf16 operands as their raw 16-bit patterns (numpy has no bf16), so it gets
    them widened to fp32 after the same roundings; exact products summed in fp32 are what the
    tensor cores compute for bf16 operands.
    """
    return os.environ.get("TRITON_INTERPRET") == "1"


def precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: fp32 inputs get fp32 products (Triton's default for fp32 would be
    tf32; tests compare tightly); bf16/fp16 inputs ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied only where its last dim is not dense (the kernels index it densely; a view such as
    value = key[..., :512] already is)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_attention_layout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, topk_indices: torch.Tensor):
    """The DSA attention kernels' common input checks: [s, b, heads, head_dim] tensors, [b, sq, topk] indices."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}: "
            "expected [s, b, heads, head_dim] each"
        )
    sq, b = query.shape[:2]
    if topk_indices.dim() != 3 or topk_indices.shape[:2] != (b, sq):
        raise ValueError(f"topk_indices {tuple(topk_indices.shape)}: expected [b={b}, sq={sq}, topk]")


def refuse_if_deterministic(op: str) -> None:
    """Under ``torch.use_deterministic_algorithms(True)`` an op that is not bitwise repeatable refuses,
    naming itself (or warns, with ``warn_only=True``), as PyTorch's own nondeterministic ops do."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    message = (
        f"{op} is not deterministic, and torch.use_deterministic_algorithms(True) is set; "
        "call it through verl_npu.ops.dispatch, which runs a deterministic backend in that mode"
    )
    if torch.is_deterministic_algorithms_warn_only_enabled():
        import warnings

        warnings.warn(message, UserWarning, stacklevel=3)
        return
    raise RuntimeError(message)
