"""Errors the runtime layer raises while loading (importable without loading the layer)."""


class StackMismatchError(RuntimeError):
    """Installed packages differ from the pinned stack."""


class LoadOrderError(RuntimeError):
    """megatron.core was imported before the Ascend adaptors could patch it."""


class CANNEnvironmentError(RuntimeError):
    """torch_npu is installed but cannot load: CANN's environment is missing."""
