"""Optimizer state repair after a megatron-core 0.18 distributed-optimizer load (torch Adam path)."""

from __future__ import annotations

import torch

from verl_npu.engine.offload import _optimizers


def resync_torch_adam_steps(optimizer) -> int:
    """After a distributed-optimizer load, give each torch Adam parameter its own, loaded ``step``.

    megatron-core 0.18's DistributedOptimizer restores the iteration count into
    ``param_groups[i]["step"]`` (where TE's FusedAdam keeps it); for torch's Adam it either skips the
    per-parameter "step" (distrib_optimizer.py, load_parameter_state_from_fs_model_space) or assigns
    one tensor to every parameter (load_state_dict without Apex/TE). torch's Adam/AdamW increment
    ``state[p]["step"]`` in place, so a stale count or a shared tensor (incremented once per
    parameter) breaks bias correction and a resumed run drifts from its second step on. Returns how
    many parameters were corrected. Remove when megatron-core restores torch Adam's step per parameter.
    """
    fixed = 0
    for inner in _optimizers(optimizer):
        seen: set[int] = set()
        for group in inner.param_groups:
            step = group.get("step")
            if step is None:
                continue
            for param in group["params"]:
                state = inner.state.get(param, {})
                current = state.get("step")
                if not isinstance(current, torch.Tensor):
                    continue
                if id(current) in seen or current.item() != float(step):
                    state["step"] = torch.tensor(float(step), dtype=current.dtype, device=current.device)
                    fixed += 1
                seen.add(id(state["step"]))
    return fixed


def ensure_torch_adam_state(optimizer) -> int:
    """Give every torch Adam parameter without state the state its first step would create.

    megatron-core 0.18's DistributedOptimizer.state_dict(), on the torch-Adam path (no TE/Apex),
    asserts that all parameters share one ``step`` (distrib_optimizer.py, ``state_dict``), which an
    optimizer that has not stepped yet has none of; so a freshly built engine could neither load a
    checkpoint (verl's resume in a new process) nor save before its first step. Zero moments and
    ``step=0`` are exactly what torch's Adam creates lazily, so training is unchanged. Returns how
    many parameters got state. Remove when megatron-core handles an empty torch optimizer there.
    """
    created = 0
    for inner in _optimizers(optimizer):
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if inner.state.get(param):
                    continue
                inner.state[param] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }
                if group.get("amsgrad"):
                    inner.state[param]["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                created += 1
    return created
