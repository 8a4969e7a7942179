"""Scenarios of the ascend_sim tier, each in a fresh process: ``python ascend_sim_run.py SCENARIO IN.json OUT.json``.

MindSpeed patches megatron for the whole process (and some of its patches cannot be undone), so every scenario
starts from a clean interpreter, activates the stand-ins (support.ascend_sim), runs verl-npu's real code over
MindSpeed's real code, and writes what it observed as JSON for the test to judge. IN.json carries the inputs: the
MindSpeed source root, the example's composed actor config, a checkpoint path.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests_npu/: `support` is importable

from support import ascend_sim, ascend_sim_router_replay


def _post_init_chain() -> list[str]:
    """What ``TransformerConfig.__post_init__`` runs, outermost first: each wrapper's file and first line (a
    functools.wraps wrapper carries its wrapped function's name, its code does not)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    chain, function = [], TransformerConfig.__post_init__
    while function is not None:
        code = function.__code__
        chain.append(f"{Path(code.co_filename).name}:{code.co_firstlineno}")
        function = getattr(function, "__wrapped__", None)
    return chain


def _config_build(bridge_class, hf, parallel, overrides) -> dict:
    """verl's vanilla-mbridge build of the TransformerConfig (AutoBridge.from_config, then set_extra_args)."""
    import torch

    try:
        bridge = bridge_class(hf, dtype=torch.bfloat16, parallel_states=parallel)
        bridge.set_extra_args(**overrides)
    except Exception as exc:  # the observation: what MindSpeed + megatron raise
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=-6)}
    config = bridge.config
    fields = ("context_parallel_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
              "expert_model_parallel_size", "experimental_attention_variant", "moe_grouped_gemm",
              "use_fused_lightning_indexer", "use_dsa_absorb")  # fmt: skip
    return {"config": {f: getattr(config, f, None) for f in fields}, "type": type(config).__name__, "bridge": bridge}


def _layer_summary(layer) -> dict:
    attention = layer.submodules.self_attention
    core = attention.submodules.core_attention
    indexer = getattr(core.submodules, "indexer", None)
    return {
        "attention": attention.module.__name__,
        "attention_submodules": sorted(vars(attention.submodules)),
        "core_attention": core.module.__name__,
        "indexer": None if indexer is None else indexer.module.__name__,
    }


def _stage_specs(bridge, pipeline: int) -> list[list[dict]]:
    """Every pipeline stage's layer specs, as the engine's bridge builds them on Ascend (megatron's local modules in
    place of TE-NPU's, see support.ascend_sim)."""
    from megatron.core import parallel_state

    parallel_state.set_pipeline_model_parallel_world_size(pipeline)
    stages = []
    for rank in range(pipeline):
        parallel_state.set_pipeline_model_parallel_rank(rank)
        block = bridge._get_transformer_layer_spec(None)
        stages.append([_layer_summary(layer) for layer in block.layer_specs])
    return stages


def engine_build(inputs: dict) -> dict:
    """The GLM-5.2 example's actor: build plan -> MindSpeed's repatch (full features list) -> MLATransformerConfig at
    the example's parallel sizes -> layer specs; first without verl-npu's CP patch, then with it, then again as a
    second engine in the same process would."""
    ascend_sim.activate(Path(inputs["mindspeed"]))
    from mbridge.core.parallel_states import ParallelStates
    from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager
    from transformers import GlmMoeDsaConfig

    from verl_npu import runtime_patches
    from verl_npu.contracts import composed
    from verl_npu.engine import build
    from verl_npu.engine.bridges import glm5
    from verl_npu.engine.build_plan import build_plan
    from verl_npu.patching import PatchEngine

    engine, optim = inputs["engine"], inputs["optim"]
    hf = GlmMoeDsaConfig.from_dict(json.loads(Path(inputs["hf_config"]).read_text()))
    parallel = ParallelStates(
        tp_size=engine["tensor_model_parallel_size"], pp_size=engine["pipeline_model_parallel_size"],
        cp_size=engine["context_parallel_size"], ep_size=engine["expert_model_parallel_size"],
        etp_size=engine["expert_tensor_parallel_size"] or 1, vpp_size=engine["virtual_pipeline_model_parallel_size"],
    )  # fmt: skip
    plan = build_plan(engine, optim, hf, "ascend")
    overrides, _ = build.engine_overrides(plan, engine.get("override_ddp_config"))
    bridge_class = glm5.register()
    from mindspeed.features_manager import create_features_list

    out: dict = {
        "features_list": [type(f).__name__ for f in MindSpeedFeaturesManager.FEATURES_LIST],
        "default_features_list": [type(f).__name__ for f in create_features_list()],
        "plan_features": list(plan.features),
    }

    # the layer's order on a node: MindSpeed imported, then verl-npu's patches scheduled (at `import verl`)
    layer = PatchEngine("ascend")
    for patch in runtime_patches.ALL:
        layer.schedule(patch)
    out["patches"] = {r.id: r.status for r in layer.records()}
    cp_patch = next(p for p in runtime_patches.ALL if p.id == CP_PATCH)

    layer.revert(cp_patch)  # MindSpeed as it is, to observe what the patch is for
    build.enter_mindspeed(plan)
    unpatched = _config_build(bridge_class, hf, parallel, overrides)
    unpatched.pop("bridge", None)
    out["without_cp_patch"] = {**unpatched, "post_init": _post_init_chain()}
    out["composed_without_cp_patch"] = [r.to_dict() for r in composed.run_checks()]

    layer.apply(cp_patch)
    out["composed"] = [r.to_dict() for r in composed.run_checks()]
    for name in ("engine", "second_engine"):
        build.enter_mindspeed(plan)
        built = _config_build(bridge_class, hf, parallel, overrides)
        bridge = built.pop("bridge", None)
        out[name] = {**built, "post_init": _post_init_chain(), "displaced": layer.displaced()}
    if bridge is not None:
        out["stages"] = _stage_specs(bridge, engine["pipeline_model_parallel_size"])
    return out


def _parity_model(inputs: dict):
    import dataclasses

    from verl_npu.parity.models import MODELS

    model = MODELS["glm5_2_fused_shape"]
    sizes = tuple(sorted({**dict(model.sizes), **inputs.get("sizes", {})}.items()))
    return dataclasses.replace(model, sizes=sizes, **inputs.get("shape", {}))


def fused_parity(inputs: dict) -> dict:
    """The parity job (verl_npu.parity.job) on MindSpeed's fused DSA path: build plan, repatch, absorbed MLA, the
    fused indexer, sparse attention and KL-loss operators (stand-ins), IndexShare, offload between steps."""
    ascend_sim.activate(Path(inputs["mindspeed"]))
    import torch
    from support import fake_torch_npu

    from verl_npu import runtime_patches
    from verl_npu.parity import job
    from verl_npu.patching import PatchEngine
    from verl_npu.testing import cpu_megatron

    layer = PatchEngine("ascend")
    for patch in runtime_patches.ALL:
        layer.schedule(patch)
    cpu_megatron.activate()
    cpu_megatron.init_model_parallel()
    torch.use_deterministic_algorithms(True, warn_only=True)

    class SimulatedAscend(job.Device):
        @property
        def torch_device(self):  # the NPU's tensors live on the CPU here
            return torch.device("cpu")

    device = SimulatedAscend("ascend", "ascend_sim (CPU)")
    runs = {}
    for dtype in inputs["dtypes"]:
        _operator_rules(dtype)
        result = _parity_job(inputs, device, dtype, "fused")
        result["operators"] = sorted(set(fake_torch_npu.CALLS))
        result["recorded"] = {kind: sorted(set(found)) for kind, found in fake_torch_npu.RECORDED.items()}
        runs[dtype] = result
    out = {"runs": runs, "displaced": layer.displaced()}
    if inputs.get("kv_halves_swapped"):  # a porting fault the comparison must see: K and V rows of kv_b_proj swapped
        out["kv_halves_swapped"] = _evaluate_with_kv_halves_swapped(inputs, device)
    return out


def _parity_job(inputs: dict, device, dtype: str, path: str) -> dict:
    """The parity job's evaluation (log-probs, checksums, every DSA layer's top-k) and training steps for the tiny
    model, from a fresh build (verl_npu.parity.job.run_model without its evaluation after training, which the
    comparisons here do not read: after Adam's first step two exact-to-rounding runs drift apart)."""
    import tempfile

    import torch
    from megatron.core import tensor_parallel

    from verl_npu.parity import job
    from verl_npu.parity.models import write_checkpoint
    from verl_npu.parity.probes import Probes

    model = _parity_model(inputs)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="verl-npu-sim-") as directory:
        built = job.build(model, write_checkpoint(model, directory), device, dtype, path)
    evaluation = job.evaluate(built, model, device, Probes(built.gpt))
    return {"eval": evaluation, "train": job.train(built, model, device, inputs["steps"]),
            "build": {"features": list(built.plan.features), "platform": built.plan.platform}}  # fmt: skip


def _operator_rules(dtype: str) -> None:
    """bf16: every documented operator rule but contiguity is enforced, as a launch runs; fp32: the fused composition
    measured at fp32 rounding, the operators' fp16/bf16 input rule recorded instead (support/fake_torch_npu.py)."""
    from support import fake_torch_npu

    fake_torch_npu.CALLS.clear()
    fake_torch_npu.RECORDED = {fake_torch_npu.CONTIGUITY: []}
    if dtype == "fp32":
        fake_torch_npu.RECORDED[fake_torch_npu.LOW_PRECISION_INPUTS] = []


def _evaluate_with_kv_halves_swapped(inputs: dict, device) -> dict:
    """fp32 evaluation (no training) with the GLM-5 bridge loading kv_b_proj's V rows as K and K rows as V."""
    import tempfile

    from verl_npu.engine.bridges import glm5
    from verl_npu.parity import job
    from verl_npu.parity.models import write_checkpoint

    model = _parity_model(inputs)
    _operator_rules("fp32")
    split = glm5.split_kv_b_proj
    glm5.split_kv_b_proj = lambda kv_b, *dims: tuple(reversed(split(kv_b, *dims)))
    try:
        with tempfile.TemporaryDirectory(prefix="verl-npu-sim-") as directory:
            built = job.build(model, write_checkpoint(model, directory), device, "fp32", "fused")
    finally:
        glm5.split_kv_b_proj = split
    return job.evaluate(built, model, device)


def _indexer_inputs_in_bf16() -> None:
    """The portable indexer selects from bf16-rounded q, k and weights, as MindSpeed's fused indexer does (it casts
    them before npu_lightning_indexer: contract mindspeed-fused-indexer-topk). Without this an fp32 comparison
    would measure that one rounding (a few of 1024 keys per row) instead of the composition."""
    import torch

    from verl_npu.ops import dispatch

    select = dispatch.dsa_indexer_topk

    def bf16_inputs(q, k, weights, topk, *, causal=True):
        return select(*(t.to(torch.bfloat16).to(t.dtype) for t in (q, k, weights)), topk, causal=causal)

    dispatch.dsa_indexer_topk = bf16_inputs


def portable_parity(inputs: dict) -> dict:
    """The same parity job on this CPU with verl-npu's portable operators (no MindSpeed): the path the fused one must
    agree with; ``bf16_indexer_inputs`` rounds the indexer's inputs as the fused indexer does."""
    import os

    from verl_npu.parity import job

    os.environ["VERL_NPU_OPS_BACKEND"] = "portable"
    device = job.start_device()
    if inputs.get("bf16_indexer_inputs"):
        _indexer_inputs_in_bf16()
    runs = {dtype: _parity_job(inputs, device, dtype, "portable") for dtype in inputs["dtypes"]}
    return {"runs": runs}


SCENARIOS = {
    "engine_build": engine_build,
    "fused_parity": fused_parity,
    "portable_parity": portable_parity,
    "router_replay": ascend_sim_router_replay.router_replay,
}
CP_PATCH = "mindspeed-dsa-cp-config"


def main(argv: list[str]) -> int:
    scenario, source, target = argv
    result = SCENARIOS[scenario](json.loads(Path(source).read_text()))
    Path(target).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
