"""The pinned stack: manifest (stack.toml), install plan, build manifest, drift lint."""

from verl_npu.stack.manifest import (
    MANIFEST_PATH,
    NPU_TARGETS,
    REPO_ROOT,
    TARGETS,
    UNVERIFIED,
    Chip,
    GitComponent,
    Package,
    Stack,
    StackError,
    load_stack,
)

__all__ = [
    "MANIFEST_PATH",
    "NPU_TARGETS",
    "REPO_ROOT",
    "TARGETS",
    "UNVERIFIED",
    "Chip",
    "GitComponent",
    "Package",
    "Stack",
    "StackError",
    "load_stack",
]
