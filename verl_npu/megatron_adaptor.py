"""verl-npu runtime layer, loaded in every process by ``import verl``.

Our images set ``VERL_USE_EXTERNAL_MODULES=verl_npu.megatron_adaptor``; verl 0.9.1 imports the
module named there with a bare ``importlib.import_module`` when ``verl`` is imported, so a failure
here stops the process loudly instead of training on the wrong stack.

Load sequence, once per process:
  1. stack check: the installed versions of every pinned distribution equal verl_npu/stack/stack.toml
     (and the image's build manifest). A mismatch raises with expected vs found;
     ``VERL_NPU_ALLOW_MISMATCH=1`` turns it into a loud warning.
"""

from __future__ import annotations

import os
import warnings

from verl_npu.stack import build_manifest
from verl_npu.stack.manifest import TARGETS, load_stack

ALLOW_MISMATCH_ENV = "VERL_NPU_ALLOW_MISMATCH"


class StackMismatchError(RuntimeError):
    """Installed packages differ from the pinned stack."""


def _target() -> str:
    env = os.environ.get("VERL_NPU_TARGET")
    if env:
        if env not in TARGETS:
            raise StackMismatchError(f"VERL_NPU_TARGET={env!r} is not a target; valid: {', '.join(TARGETS)}")
        return env
    path = build_manifest.find()
    if path is not None and path.is_file():
        return build_manifest.read(path)["target"]
    return "dev"


def check_stack() -> list[str]:
    """Return the mismatches (empty when the stack is as pinned); raise unless allowed."""
    stack = load_stack()
    target = _target()
    mismatches = []
    for dist, expected in sorted(stack.expected_versions(target).items()):
        found = build_manifest.installed_version(dist)
        if not build_manifest.same_version(found, expected):
            mismatches.append(f"{dist}: expected {expected}, found {found or 'not installed'}")
    if not mismatches:
        return []
    message = (
        f"verl-npu: installed packages differ from the pinned stack (target {target}):\n  "
        + "\n  ".join(mismatches)
        + f"\nFix: bash install.sh --target {target} (run `verl-npu doctor` for details), "
        f"or set {ALLOW_MISMATCH_ENV}=1 to continue at your own risk."
    )
    if os.environ.get(ALLOW_MISMATCH_ENV) == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return mismatches
    raise StackMismatchError(message)


STACK_MISMATCHES = check_stack()
