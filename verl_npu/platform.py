"""Which accelerator this process runs on: ascend, cuda or cpu.

The platform kinds and the node's NPU device files come from the one node detector,
verl_npu.stack.detect (install.sh's and doctor's too); this module adds what only a running process
knows: whether torch_npu loads and sees an NPU.
"""

from __future__ import annotations

import importlib.util
import os

from verl_npu.errors import CANNEnvironmentError, warn_loudly
from verl_npu.stack.detect import KINDS, NPU_DEVICE_FILES, npu_device_files

PLATFORM_ENV = "VERL_NPU_PLATFORM"
SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"
__all__ = ["KINDS", "NPU_DEVICE_FILES", "PLATFORM_ENV", "SET_ENV", "detect", "npu_device_files"]


def detect(device_files: list[str] | None = None) -> str:
    """``$VERL_NPU_PLATFORM`` if set (tests, dry runs), else probe torch_npu, then CUDA.

    torch_npu failing to load is an error only where NPUs exist. In the verl-npu image on a node or
    pod without NPUs (a KubeRay head that runs only the driver) it cannot load either, because the
    host driver is not mounted there; that process runs on CPU.
    """
    forced = os.environ.get(PLATFORM_ENV)
    if forced:
        if forced not in KINDS:
            raise ValueError(f"{PLATFORM_ENV}={forced!r}; use {', '.join(KINDS[:-1])} or {KINDS[-1]}")
        return forced
    import torch

    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401
        except Exception as exc:  # without CANN it raises ImportError, OSError, even UnicodeDecodeError
            devices = npu_device_files() if device_files is None else device_files
            if devices:
                raise CANNEnvironmentError(
                    f"torch_npu is installed but failed to load ({type(exc).__name__}: {exc}), and this node has "
                    f"NPUs ({', '.join(devices[:4])}{', ...' if len(devices) > 4 else ''}). "
                    f"Source CANN's environment first: `source {SET_ENV}` "
                    "(the verl-npu images' entrypoint does this), then run `verl-npu doctor`."
                ) from exc
            warn_loudly(
                f"torch_npu cannot load here ({type(exc).__name__}: {exc}) and this node has no NPU device "
                f"({NPU_DEVICE_FILES}): running on {'cuda' if torch.cuda.is_available() else 'cpu'}. "
                "Expected on a Ray head or driver pod without NPUs; on a training node, mount the NPUs and the "
                "driver (/usr/local/Ascend/driver) and run `verl-npu doctor`."
            )
        else:
            if torch.npu.is_available():
                return "ascend"
    return "cuda" if torch.cuda.is_available() else "cpu"
