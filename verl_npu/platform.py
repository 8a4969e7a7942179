"""Which accelerator this process runs on: ascend, cuda or cpu."""

from __future__ import annotations

import glob
import importlib.util
import os

from verl_npu.errors import CANNEnvironmentError, warn_loudly

PLATFORM_ENV = "VERL_NPU_PLATFORM"
SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"
NPU_DEVICE_FILES = "/dev/davinci[0-9]*"


def npu_device_files(pattern: str = NPU_DEVICE_FILES) -> list[str]:
    """The NPU device nodes of this node or container (what Ray also counts when acl is absent)."""
    return sorted(glob.glob(pattern))


def detect(device_files: list[str] | None = None) -> str:
    """``$VERL_NPU_PLATFORM`` if set (tests, dry runs), else probe torch_npu, then CUDA.

    torch_npu failing to load is an error only where NPUs exist. In the verl-npu image on a node or
    pod without NPUs (a KubeRay head that runs only the driver) it cannot load either, because the
    host driver is not mounted there; that process runs on CPU.
    """
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
