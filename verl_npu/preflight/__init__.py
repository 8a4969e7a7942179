"""``verl-npu preflight``: is a launch valid for verl 0.9.1 + verl_npu, and does it fit?

A 32-node job waits hours in a queue and then dies in minutes on a typo, a mesh that does not
divide or an out-of-memory. Preflight answers before it queues, on any machine (no NPU):

1. ``launch``: the bash launch script is read statically (never run) and the trainer's overrides
   recovered, with script bugs it can see;
2. ``compose``: the overrides composed with verl's own Hydra config; ``verl_validation``: verl's own validation
   of it, in a child process that imports torch (``worker``); ``engine_checks``: the engine's build plan and the
   model family's bridge for each Megatron role, and what the rollout can serve;
3. ``mesh``: the device mesh of every role;
4. ``memory``: HBM per device per pipeline stage and host RAM per node;
5. ``startup``: the checkpoint bytes each node loads, the load's time at the nodes' read rate, and the HCCL
   timeouts it needs (docs/preflight_startup.md).

``pipeline`` runs them in that order (:func:`run_preflight`); ``report`` holds the result type and its output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verl_npu.preflight.pipeline import run_preflight

__all__ = ["run_preflight"]


def __getattr__(name: str) -> Any:
    """``run_preflight`` on first use: the worker (``python -m verl_npu.preflight.worker``) and the CLI, which starts
    it before anything else, import this package and must not wait for the pipeline's modules."""
    if name == "run_preflight":
        from verl_npu.preflight.pipeline import run_preflight

        return run_preflight
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
