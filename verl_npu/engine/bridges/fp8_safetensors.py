"""Read an FP8 block-scaled HF checkpoint (DeepSeek-V3's format, GLM-5.x's FP8 releases) as bf16.

The format: a quantised linear weight ``W`` is stored as float8 e4m3 codes, with ``W_scale_inv``, a
float32 tensor of one scale per 128x128 block (``weight_block_size`` in the config's
``quantization_config``); the weight is ``code * scale`` of its block. RL trains in bf16, so the GLM-5
bridge dequantises on load and exports bf16 (the Ascend rollout is bf16 too: vllm-ascend's FP8 path is
MXFP8 for the 950, and SFA asserts an unquantised ``kv_b_proj``).

Why not mbridge 0.15.1's ``DequantFP8SafeTensorIO``: it dequantises with a Triton kernel, which does not run
on the CPU (where mbridge reads checkpoints) and has not been checked on Ascend; it needs
``model.safetensors.index.json``; and it loads a weight whose scale is missing as raw FP8 codes after a
print. This reader uses plain torch on the CPU (A2/A3 NPUs have no FP8 arithmetic), reads the files' own
headers when there is no index, and refuses a weight without its scale.
"""

from __future__ import annotations

import torch
from mbridge.core.safetensor_io import SafeTensorIO

from verl_npu.engine.bridges.fast_read import ParallelSafeTensorIO

SCALE_SUFFIX = "_scale_inv"
BLOCK = 128  # weight_block_size of DeepSeek-V3 and GLM-5.x FP8 checkpoints
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def checkpoint_names(hf_dir: str) -> list[str]:
    """Every tensor name of a safetensors checkpoint: from its index file, else from the files' headers."""
    return SafeTensorIO(hf_dir).load_hf_weight_names()


def is_fp8_block_scaled(hf_dir: str) -> bool:
    return any(name.endswith(SCALE_SUFFIX) for name in checkpoint_names(hf_dir))


def dequantize(codes: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """bf16 of ``codes * scale`` of each block, computed in float32 (as DeepSeek-V3's reference kernel does)."""
    rows, cols = codes.shape
    expected = (-(-rows // block), -(-cols // block))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 weight of shape {tuple(codes.shape)} needs a scale of shape {expected} ({block}x{block} blocks), "
            f"got {tuple(scale.shape)}"
        )
    per_element = scale.float().repeat_interleave(block, dim=0)[:rows].repeat_interleave(block, dim=1)[:, :cols]
    return (codes.float() * per_element).to(torch.bfloat16)


class BlockFP8SafeTensorIO(ParallelSafeTensorIO):
    """mbridge's reader (read in parallel), with FP8 weights dequantised to bf16 on the host (other tensors as stored).
    The engine's load dequantises on the device instead (verl_npu.engine.bridges.fast_load)."""

    def __init__(self, hf_dir: str):
        super().__init__(hf_dir)
        self._names = set(self.load_hf_weight_names())  # the index's, or every file's header (no index file)

    def load_some_hf_weight(self, hf_weight_names: list[str]) -> dict:
        tensors = super().load_some_hf_weight(hf_weight_names)
        quantised = [name for name, tensor in tensors.items() if tensor.dtype in _FP8_DTYPES]
        if not quantised:
            return tensors
        missing = sorted(name for name in quantised if name + SCALE_SUFFIX not in self._names)
        if missing:
            raise ValueError(f"FP8 checkpoint {self.hf_dir}: no {SCALE_SUFFIX} for {missing}")
        scales = super().load_some_hf_weight([name + SCALE_SUFFIX for name in quantised])
        for name in quantised:
            tensors[name] = dequantize(tensors[name], scales[name + SCALE_SUFFIX])
        return tensors
