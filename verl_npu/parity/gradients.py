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
    from verl_npu.parity.models import uniform

    out: dict[str, dict[str, Any]] = {}
    for name, tensor in named:
        if tensor is None:
            continue
        key = canonical(name)
        values = tensor.detach().to("cpu").double().numpy().ravel()
        directions = np.stack([uniform(f"parity/sketch/{key}/{k}", values.size) for k in range(SKETCH_DIM)])
        entry = out.setdefault(group(key), {"sketch": np.zeros(SKETCH_DIM), "square": 0.0, "size": 0})
        entry["sketch"] += directions @ values
        entry["square"] += float(values @ values)
        entry["size"] += values.size
    return {
        g: {"sketch": [float(x) for x in e["sketch"]], "norm": float(np.sqrt(e["square"])), "size": e["size"]}
        for g, e in sorted(out.items())
    }
