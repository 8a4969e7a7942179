"""What a preflight checks a launch for: the chip (its HBM per device) and the platform its engine builds for.

Decided once by :func:`verl_npu.preflight.pipeline.run_preflight` and handed to both the build plans and the
memory estimate (:mod:`verl_npu.preflight.memory_plan`), which is why it lives apart from either.
"""

from __future__ import annotations

import dataclasses

ASCEND = "ascend"  # every chip of the stack manifest (a2, a3) is an Ascend NPU


@dataclasses.dataclass(frozen=True)
class Target:
    """What the launch runs on: the chip, its HBM per device, and the platform the engine builds for."""

    chip: str
    platform: str
    hbm_bytes: int


def target(chip: str, platform: str | None = None) -> Target:
    """The chip's target from the stack manifest; ``platform`` overrides the chip's (``ascend``) to check the same
    launch as another platform's engine would build it."""
    from verl_npu.engine.build_plan import PLATFORMS
    from verl_npu.preflight.memory import GiB
    from verl_npu.stack.manifest import load_stack

    chips = load_stack().chips
    if chip not in chips:
        raise ValueError(f"chip {chip!r}: the stack manifest knows {', '.join(sorted(chips))}")
    platform = platform or ASCEND
    if platform not in PLATFORMS:
        raise ValueError(f"platform {platform!r}: use one of {', '.join(PLATFORMS)}")
    return Target(chip, platform, chips[chip].hbm_gib * GiB)
