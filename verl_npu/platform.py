"""Which accelerator this process runs on: ascend, cuda or cpu."""

from __future__ import annotations

import importlib.util
import os

from verl_npu.errors import CANNEnvironmentError

PLATFORM_ENV = "VERL_NPU_PLATFORM"
SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"


def detect() -> str:
    """``$VERL_NPU_PLATFORM`` if set (tests, dry runs), else probe torch_npu, then CUDA."""
    forced = os.environ.get(PLATFORM_ENV)
    if forced:
        if forced not in ("ascend", "cuda", "cpu"):
            raise ValueError(f"{PLATFORM_ENV}={forced!r}; use ascend, cuda or cpu")
        return forced
    import torch

    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401
        except Exception as exc:  # without CANN it raises ImportError, OSError, even UnicodeDecodeError
            raise CANNEnvironmentError(
                f"torch_npu is installed but failed to load ({type(exc).__name__}: {exc}). "
                f"Source CANN's environment first: `source {SET_ENV}` "
                "(the verl-npu images' entrypoint does this), then run `verl-npu doctor`."
            ) from exc
        if torch.npu.is_available():
            return "ascend"
    return "cuda" if torch.cuda.is_available() else "cpu"
