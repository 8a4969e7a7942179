"""Errors the runtime layer raises while loading (importable without loading the layer)."""

import sys
import warnings


class UserError(ValueError):
    """An expected failure caused by what the user gave (a file, a value, an option).

    The CLI prints its message as one line and exits 2 (docs/errors.md); the message must name the
    offending key, file or value and how to fix it. Anything else that escapes a command is a bug:
    the CLI prints a short message and the traceback only with --debug.
    """


class StackMismatchError(RuntimeError):
    """Installed packages differ from the pinned stack."""


class LoadOrderError(RuntimeError):
    """megatron.core was imported before the Ascend adaptors could patch it."""


class CANNEnvironmentError(RuntimeError):
    """torch_npu is installed but cannot load: CANN's environment is missing."""


def warn_loudly(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """A warning that no log level hides: Python's warning plus a line on stderr, on every rank."""
    warnings.warn(message, category, stacklevel=3)
    print(f"[verl-npu] WARNING: {message}", file=sys.stderr)
