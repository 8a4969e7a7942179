"""Router replay (R2/R3) that lays routes on the padded (BSHD) rows the engine's routers see.

Changes: wraps verl's ``merge_router_topk_indices`` (R2's record) and ``set_router_replay_data`` (the replay of
R2 and R3) in ``verl.utils.megatron.router_replay_utils``, and the names verl's Megatron engine imported from it.
Inside a forward the NPU engine runs on the padded layout (``use_remove_padding=False``; verl_npu.engine.verl_engine
marks it), the routes are read from and written to the routers' ``[seq, batch]`` rows by
verl_npu.engine.router_replay, by verl's BSHD padding rule and SP/CP split; padding rows keep their own routes.
Every other call (the packed THD layout, other engines) runs verl's function unchanged.
Why: verl 0.9.1 handles packed input only. Its engine hands both functions jagged per-sample tensors, so they take
their THD branch and read the padded forward's rows as if they were packed: the recorded routes belong to other
tokens and positions, a replay attaches them to the wrong rows (under a different micro-batch split about as many
routes change as with no replay), padding rows get expert 0 twice, and R3's mask, one entry per real token,
does not match the router's rows (``Router replay tensors are not aligned``). DSA models run BSHD only, so every
GLM-5.2 run with replay went through it (docs/router_replay.md).
Upstream: verl 0.9.1 verl/utils/megatron/router_replay_utils.py (merge_router_topk_indices, set_router_replay_data),
verl/workers/engine/megatron/transformer_impl.py (MegatronEngine.forward_step), verl/models/mcore/util.py
(preprocess_bshd_engine, postprocess_bshd_engine).
Remove when: verl's record and replay lay out BSHD input themselves, or DSA runs packed (THD) input and the build
plan stops refusing use_remove_padding=True for it.
"""

from __future__ import annotations

import functools
from types import MappingProxyType

import torch

from verl_npu.patching import Patch
from verl_npu.runtime_patches._targets import EVERY_PLATFORM

_MODULE = "verl.utils.megatron.router_replay_utils"
_VERL = MappingProxyType({"verl": "==0.9.1"})


def _device_of(model) -> torch.device:
    chunks = model if isinstance(model, list | tuple) else [model]
    return next(p for chunk in chunks for p in chunk.parameters()).device


def _model_routers(model) -> list[tuple[int, object]]:
    from verl.utils.megatron.router_replay_utils import iter_model_routers

    if model is None:
        raise RuntimeError(
            "verl-npu router replay: the padded layout needs the forwarded model to find its routers; "
            "verl 0.9.1's engine passes model=..., this caller did not"
        )
    return sorted(iter_model_routers(model), key=lambda item: item[0])


def _build_record(original):
    @functools.wraps(original)
    def merge_router_topk_indices(
        attention_mask,
        input_ids,
        mini_layer_topk_idx_list,
        tf_config,
        vp_rank=None,
        local_cp_size=None,
        model=None,
    ):
        from verl_npu.engine import router_replay

        batch = router_replay.current_padded_batch()
        if batch is None:
            return original(
                attention_mask, input_ids, mini_layer_topk_idx_list, tf_config, vp_rank, local_cp_size, model
            )
        routers = _model_routers(model)
        numbers = [number for number, _ in routers]
        if not routers or len(set(numbers)) != len(numbers) or any(r.recorded_topk_idx is None for _, r in routers):
            # verl's answer for a stage without MoE layers (layout-free) and its errors for an incomplete record
            return original(
                attention_mask, input_ids, mini_layer_topk_idx_list, tf_config, vp_rank, local_cp_size, model
            )
        layout = router_replay.PaddedLayout.of(batch, tf_config)
        with torch.no_grad():
            routes = router_replay.record([r for _, r in routers], layout, tf_config, _device_of(model))
        mini_layer_topk_idx_list.append(routes)

    return merge_router_topk_indices


def _build_replay(original):
    @functools.wraps(original)
    def set_router_replay_data(
        layers_topk_idx,
        attention_mask,
        tf_config,
        vp_rank=None,
        replay_mask=None,
        local_cp_size=None,
        model=None,
    ):
        from verl.utils.megatron.router_replay_utils import is_moe_layer

        from verl_npu.engine import router_replay

        batch = router_replay.current_padded_batch()
        if batch is None:
            return original(layers_topk_idx, attention_mask, tf_config, vp_rank, replay_mask, local_cp_size, model)
        if layers_topk_idx is None:
            raise RuntimeError("router_replay REPLAY requires routed_experts from the preceding RECORD forward.")
        if not layers_topk_idx.is_nested:
            raise RuntimeError(
                "verl-npu router replay: routed_experts must be a jagged per-sample tensor as verl 0.9.1's engine "
                f"hands it, found a dense {tuple(layers_topk_idx.shape)}"
            )
        routers = _model_routers(model)
        if not routers:
            raise RuntimeError("router_replay REPLAY found no routers in the forwarded model.")
        layout = router_replay.PaddedLayout.of(batch, tf_config)
        with torch.no_grad():
            targets, keep = router_replay.replay_targets(
                layers_topk_idx, replay_mask, layout, tf_config, _device_of(model)
            )
        route_layers = targets.shape[1]
        # verl's rule: routes for every layer (R3 from some rollouts) are indexed by layer, MoE-only ones by ordinal
        by_layer = route_layers == tf_config.num_layers
        missing = []
        for number, router in routers:
            layer = number - 1
            index = layer if by_layer else sum(1 for i in range(layer) if is_moe_layer(tf_config, i))
            if not 0 <= index < route_layers:
                missing.append(number)
                continue
            router.set_target_indices(targets[:, index].contiguous(), replay_mask=keep)
        if missing:
            raise RuntimeError(
                "router_replay REPLAY data does not cover every forwarded MoE layer: "
                f"missing_layer_numbers={missing}, route_layers={route_layers}, vp_rank={vp_rank}"
            )

    return set_router_replay_data


_REASON = (
    "verl 0.9.1 records and replays routes on the packed (THD) row layout only; the engine runs DSA models padded "
    "(BSHD, [seq, batch] rows), where its record reads other tokens' routes and its replay lands on the wrong rows "
    "(R3 raises); routes are laid on the padded rows by verl's BSHD padding rule, padding rows routed natively"
)
_UPSTREAM = "verl 0.9.1 verl/utils/megatron/router_replay_utils.py, verl/models/mcore/util.py::preprocess_bshd_engine"
_REMOVE_WHEN = "verl's record and replay handle BSHD input, or DSA runs packed input (use_remove_padding=True)"

RECORD = Patch(
    id="router-replay-padded-record",
    target=f"{_MODULE}:merge_router_topk_indices",
    kind="wrap",
    platforms=EVERY_PLATFORM,
    requires=_VERL,
    source_sha256="09b4ed21fcdc268076f9145ec8861d7f29b26a7a01c3edfbf9703f9a68e7aa7e",
    reason=_REASON,
    upstream=_UPSTREAM,
    remove_when=_REMOVE_WHEN,
    build=_build_record,
)
REPLAY = Patch(
    id="router-replay-padded-replay",
    target=f"{_MODULE}:set_router_replay_data",
    kind="wrap",
    platforms=EVERY_PLATFORM,
    requires=_VERL,
    source_sha256="d9704a081830cce0b50cbf8c603a899810b6764b694de0a1d7b34c236c541221",
    reason=_REASON,
    upstream=_UPSTREAM,
    remove_when=_REMOVE_WHEN,
    build=_build_replay,
)
PATCHES = (RECORD, REPLAY)
