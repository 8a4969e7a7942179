"""Tiny models for verl_npu.engine.bridges.fast_export's tests, and one rank of its parallel run (CPU, gloo).

    python fast_export_parallel.py RANK WORLD PORT WORKDIR

Each rank builds, layout after layout (:data:`LAYOUTS`), a tiny dense Qwen2 and a tiny GLM-5 through their mbridge
bridges on the local spec (random weights, random router expert biases), exports them through the fast export and
through mbridge 0.15.1's ``Bridge.export_weights``, and writes to ``WORKDIR/rank<R>-of-<WORLD>.pt`` per layout the
exported names, the differences between the two exports, the collectives the fast one made, and where the fast
load of that export (written as an HF checkpoint) does not give the model back. Needs the repository
root and tests_npu/ on PYTHONPATH; uses the CPU harness of verl_npu/testing/cpu_megatron.py.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Any

import torch

# bench/rl_step_models.py's --tiny dense model, with 4 layers: PP=2 x VPP=2 puts one on each virtual stage
DENSE = dict(
    vocab_size=512, hidden_size=128, intermediate_size=320, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
)  # fmt: skip
# GLM-5-shaped (tests_npu/engine/test_glm5_bridge.py's): a dense layer, then a MoE layer with routed experts and the
# router's expert bias; half-split RoPE pairs, so the bridge reorders rotary rows on export
GLM5 = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    mlp_layer_types=["dense", "sparse"], first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=8,
    max_position_embeddings=64, tie_word_embeddings=False, rope_interleave=False, indexer_rope_interleave=False,
)  # fmt: skip
# (model, parallel sizes) per layout of two ranks
LAYOUTS: dict[str, tuple[str, dict[str, int]]] = {
    "dense-pp2-vpp2": ("dense", dict(pp=2, vpp=2)),
    "dense-tp2": ("dense", dict(tp=2)),
    "glm5-pp2": ("glm5", dict(pp=2)),
    "glm5-tp2-ep2": ("glm5", dict(tp=2, ep=2)),
}
COUNTED = ("all_gather_object", "broadcast_object_list", "broadcast")


def hf_config(model: str) -> Any:
    from transformers import GlmMoeDsaConfig, Qwen2Config

    config = Qwen2Config(**DENSE) if model == "dense" else GlmMoeDsaConfig(**GLM5)
    # verl puts rope_theta on the root, where mbridge reads it (transformers 5 keeps it in rope_parameters)
    config.rope_theta = config.rope_parameters["rope_theta"]
    return config


def build(model: str, seed: int = 1) -> tuple[Any, list[torch.nn.Module]]:
    """(bridge, model chunks) of ``model`` for megatron's current parallel state: random bf16 weights, and random
    expert biases (megatron starts them at zero, which would not tell a stale or misplaced bias from the live one)."""
    from mbridge import AutoBridge
    from megatron.core import tensor_parallel

    import verl_npu.megatron_adaptor  # noqa: F401  (runtime patches: DSA on the CPU, GLM-5's bridge registered)
    from verl_npu.engine.mbridge_local import build_on_local_spec

    config = hf_config(model)
    bridge = AutoBridge.from_config(config, dtype=torch.bfloat16)  # its own name table (mbridge-instance-name-table)
    bridge.set_extra_args(
        use_cpu_initialization=True, moe_token_dispatcher_type="allgather", variable_seq_lengths=False
    )
    build_on_local_spec(bridge, fused_rmsnorm=True)  # verl-npu's RMSNorm takes sequence-parallel input
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    models = bridge.get_model(wrap_with_ddp=False, bf16=True)
    generator = torch.Generator().manual_seed(seed + 1000 * bridge.mpu.pp_rank)
    for chunk in models:
        for name, buffer in chunk.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator))
    return bridge, models


def mbridge_export(bridge: Any, models: list[torch.nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """What mbridge 0.15.1's own export yields for ``bridge`` (whatever its class overrides)."""
    from mbridge.core.bridge import Bridge

    return list(Bridge.export_weights(bridge, models))


def differences(ours: list[tuple[str, torch.Tensor]], theirs: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Where two exports differ: names and their order, then per tensor its class, device, shape, dtype and bytes."""
    if [name for name, _ in ours] != [name for name, _ in theirs]:
        return [f"names: {[n for n, _ in ours]} != {[n for n, _ in theirs]}"]
    found = []
    for (name, a), (_, b) in zip(ours, theirs, strict=True):
        if (type(a), a.device, a.shape, a.dtype) != (type(b), b.device, b.shape, b.dtype):
            found.append(f"{name}: {type(a).__name__} {a.device} {a.shape} {a.dtype} != {type(b).__name__} "
                         f"{b.device} {b.shape} {b.dtype}")  # fmt: skip
        elif not torch.equal(_bytes(a), _bytes(b)):
            found.append(f"{name}: other values")
    return found


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def count_calls(setattr_: Any, names: tuple[str, ...] = COUNTED) -> collections.Counter:
    """Count the calls to ``torch.distributed.<name>`` from now on (``setattr_``: a MonkeyPatch's setattr)."""
    counts: collections.Counter = collections.Counter()
    for name in names:
        original = getattr(torch.distributed, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr_(torch.distributed, name, counted)
    return counts


def megatron_tensor_count(models: list[torch.nn.Module]) -> int:
    """The megatron tensors an export walks on this rank: parameters and the router's expert biases."""
    from mbridge.core.util import unwrap_model

    total = 0
    for chunk in unwrap_model(models):
        names = {name for name, _ in chunk.named_parameters()}
        biases = [n for n in chunk.state_dict() if "_extra_state" not in n and "expert_bias" in n and n not in names]
        total += len(names) + len(biases)
    return total


def load_round_trip(model: str, bridge: Any, models: list[torch.nn.Module], exported, directory: Path) -> list[str]:
    """Where the fast load of ``exported`` (the HF tensors, written by rank 0 in two files with an index) does not
    give the model back its own values (each parameter zeroed first)."""
    from safetensors.torch import save_file

    from verl_npu.engine.bridges import fast_load

    if torch.distributed.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        names = [name for name, _ in exported]
        files = {name: f"model-{1 + (i >= len(names) // 2)}.safetensors" for i, name in enumerate(names)}
        for file in sorted(set(files.values())):
            save_file({n: t.detach().contiguous() for n, t in exported if files[n] == file}, str(directory / file))
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": files}))
        bridge.hf_config.save_pretrained(directory)  # mbridge finds the checkpoint by its config.json
    torch.distributed.barrier()
    before = [
        {n: t.detach().clone() for n, t in chunk.state_dict().items() if "_extra_state" not in n} for chunk in models
    ]
    with torch.no_grad():
        for chunk in models:
            for param in chunk.parameters():
                param.zero_()
    if model == "dense":
        fast_load.load_weights(bridge, models, str(directory))
    else:
        bridge.load_weights(models, str(directory))  # GLM5Bridge's: the fast load, then the local-spec experts
    found = []
    for index, (chunk, expected) in enumerate(zip(models, before, strict=True)):
        for name, tensor in chunk.state_dict().items():
            if name in expected and not torch.equal(_bytes(tensor), _bytes(expected[name])):
                found.append(f"chunk {index} {name}")
    return found


def run_layout(
    model: str, *, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1, checkpoint: Path | None = None
) -> dict[str, Any]:
    import pytest
    from megatron.core import parallel_state

    from verl_npu.engine.bridges import fast_export

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
    )  # fmt: skip
    bridge, models = build(model)
    theirs = mbridge_export(bridge, models)
    with pytest.MonkeyPatch.context() as patch:
        counts = count_calls(patch.setattr)
        ours = list(fast_export.export_weights(bridge, models))
    tensors = torch.tensor(megatron_tensor_count(models))
    torch.distributed.all_reduce(tensors, group=parallel_state.get_pipeline_model_parallel_group())
    return {
        "names": [name for name, _ in ours],
        "differences": differences(ours, theirs),
        "counts": dict(counts),
        "chunks": len(models),
        "pipeline_tensors": int(tensors),  # the tensors of every stage, each broadcast once under PP
        "load_differences": None if checkpoint is None else load_round_trip(model, bridge, models, ours, checkpoint),
    }


def main(rank: int, world: int, port: int, workdir: Path) -> None:
    import torch.distributed as dist

    from verl_npu.testing import cpu_megatron

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cpu_megatron.activate()
    results = {
        layout: run_layout(model, **sizes, checkpoint=workdir / f"hf-{layout}")
        for layout, (model, sizes) in LAYOUTS.items()
    }
    torch.save(results, workdir / f"rank{rank}-of-{world}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from support.gloo_ranks import rank_entry

    rank_entry(lambda a: main(a.rank, a.world, a.port, a.workdir))
