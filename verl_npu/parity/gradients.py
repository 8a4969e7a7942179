"""One training step's gradients and parameter update, per parameter group, as sketches every platform can compare.

A group is one block of the model: ``embedding``, ``layers.N.self_attention`` (the attention block with its input
norm), ``layers.N.mlp`` (the MLP or MoE block with its norm and router), ``final_layernorm``, ``output_layer``. A
group's sketch is ``SKETCH_DIM`` projections of its concatenated values on fixed directions drawn by the parity
models' counter-based generator from each parameter's canonical name, plus its L2 norm. The sketch is linear, so
two runs' sketches differ by the sketch of their difference: its size is, up to a factor every group shares, the
size of the difference, and a sign flip, a permutation or a missing term shows as much as a change of norm.

Canonical names: a layer spec that fuses a norm into the next linear (TransformerEngine's, on Ascend TE-NPU's) names
the norm's weight after that linear; it is named as the local spec names it (verl_npu/engine/mbridge_local.py has
the pairs), so both builds sketch the same vector.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np

SKETCH_DIM = 16
_LAYER = re.compile(r"(?:^|\.)layers\.([0-9]+)\.(.*)")


def canonical(name: str) -> str:
    """A parameter's name without its wrappers' prefixes, a fused norm's weight under its local-spec name."""
    from verl_npu.engine.mbridge_local import LOCAL_TO_TE_NAMES

    while name.startswith("module."):
        name = name[len("module.") :]
    for local, te in LOCAL_TO_TE_NAMES:
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def group(name: str) -> str:
    """The block a (canonical) parameter name belongs to."""
    m = _LAYER.search(name)
    if m is not None:
        rest = m[2]
        block = "mlp" if rest.startswith(("mlp.", "pre_mlp_layernorm.")) else "self_attention"
        return f"layers.{m[1]}.{block}"
    parts = name.split(".")
    return next((top for top in ("embedding", "output_layer", "final_layernorm") if top in parts), name)


def sketches(named: Iterable[tuple[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per group: ``sketch`` (SKETCH_DIM projections) and ``norm`` of the named tensors (parameters' gradients,
    updates), in float64 on the host."""
    import torch

    from verl_npu.parity.models import uniform

    out: dict[str, dict[str, Any]] = {}
    for name, tensor in named:
        if tensor is None:
            continue
        key = canonical(name)
        # a copy: numpy would otherwise share (and pin the size of) a CPU tensor's storage, which offload resizes
        values = tensor.detach().to("cpu", torch.float64, copy=True).numpy().ravel()
        directions = np.stack([uniform(f"parity/sketch/{key}/{k}", values.size) for k in range(SKETCH_DIM)])
        entry = out.setdefault(group(key), {"sketch": np.zeros(SKETCH_DIM), "square": 0.0, "size": 0})
        entry["sketch"] += directions @ values
        entry["square"] += float(values @ values)
        entry["size"] += values.size
    return {
        g: {"sketch": [float(x) for x in e["sketch"]], "norm": float(np.sqrt(e["square"])), "size": e["size"]}
        for g, e in sorted(out.items())
    }


ADAM_EPS = 1e-8  # megatron-core 0.18's OptimizerConfig.adam_eps, which the parity job leaves as is


def no_weight_decay(name: str, shape: tuple[int, ...]) -> bool:
    """megatron-core 0.18's default rule (optimizer/__init__.py): biases and one-dimensional parameters (norm
    weights) take no weight decay."""
    return len(shape) == 1 or name.endswith(".bias")


def expected_update(before: dict[str, Any], grads: dict[str, Any], optimizer: dict[str, Any], max_norm: float):
    """What AdamW's first step does to each parameter, in float64 on the host: the gradients clipped to
    ``max_norm`` by their global L2 norm (coefficient max_norm / (norm + 1e-6) when below 1, as megatron clips),
    then -lr * (wd * p + g / (|g| + eps)): at step 1 the bias-corrected moments are g and g^2."""
    import torch

    norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads.values())))
    coefficient = min(1.0, max_norm / (norm + 1.0e-6))
    lr, wd = optimizer["lr"], optimizer["weight_decay"]
    out = {}
    for name, p in before.items():
        g = grads.get(name)
        decay = 0.0 if no_weight_decay(name, tuple(p.shape)) else wd
        step = torch.zeros_like(p) if g is None else (g * coefficient) / ((g * coefficient).abs() + ADAM_EPS)
        out[name] = -lr * (decay * p + step)
    return out


def update_check(before: dict[str, Any], grads: dict[str, Any], after: dict[str, Any], optimizer, max_norm: float):
    """Step 0's update as the platform's optimizer made it (``after - before``, the offload manager's round trip
    included) and as AdamW makes it from the same gradients (:func:`expected_update`), sketched per group."""
    expected = expected_update(before, grads, optimizer, max_norm)
    return {
        "actual": sketches((name, after[name] - before[name]) for name in before),
        "expected": sketches(expected.items()),
    }
