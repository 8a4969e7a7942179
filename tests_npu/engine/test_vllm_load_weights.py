"""The rollout weight sync executed: verl-npu's engine exports a scaled GLM-5.2 into vLLM 0.23.0's model under
vllm-ascend (the pinned release), through verl 0.9.1's own sync code, and vLLM ends up with the checkpoint.

This is the export's test (it replaced a hand-written model of the names vLLM's ``load_weights`` consumes; the recorded
facts of verl_npu/contracts/vllm.py stay, for drift, and are checked here against the model vLLM builds).

The model: GLM-5.2's published architecture (examples/glm5_2/config.json) with smaller sizes: its full/shared DSA
layer pattern, interleaved RoPE, K/V head dims 192/256 with a 64-dim rope, the sigmoid router with
``e_score_correction_bias``, a shared expert, three dense layers first, one MTP layer; 8 layers, hidden 64, 4 heads,
4 experts, vocabulary 128, 128 positions (vLLM and the engine keep RoPE tables as long as that). The experts' inner
size 48 keeps every expert weight's two dims apart from the hidden size: verl's NPU loader tells a transposed expert
weight by comparing a dim with the hidden size (hidden 6144 and inner 2048 in GLM-5.2).

What runs for real: verl-npu's engine and GLM-5 bridge (``get_per_tensor_param``, BF16, on the CPU harness); verl's
``BucketedWeightSender`` and ``vLLMColocateWorkerExtension.update_weights_from_ipc`` (buckets, ``load_weights`` per
bucket, ``process_weights_after_loading`` once), with verl's NPU patches and its GLM-5.2 patch as the example enables
it; vLLM's ``GlmMoeDsaForCausalLM`` (as vllm-ascend subclasses it) and model loader; vllm-ascend's platform, its
worker and platform patches (``patch_deepseek_v2`` builds no indexer on shared layers), its layers
(``register_ascend_customop``: linear layers, norms, embeddings, MLA with its SFA attention, fused MoE) and their
``process_weights_after_loading``. What stands in is listed in tests_npu/support/vllm_cpu.py (torch_npu and CANN,
NPU memory, HCCL, NPU IPC, the worker process).

vLLM's Python comes from its sdist, not its 274 MB wheel: the Ascend images install vLLM from its source tree with
``VLLM_TARGET_DEVICE=empty``, and what the wheel adds comes from its CUDA build (compiled kernels, and the Python of
``vllm_flash_attn``, ``third_party/triton_kernels``, ``third_party/flashmla`` and DeepGEMM that the build copies in),
none of which that install has or this path imports.

Each broken export below (a tensor missing, a shared layer's indexer sent, K and V swapped in ``kv_b_proj``) fails
the same checks as the real one passes, naming what went wrong.
"""

from __future__ import annotations

import re
import zipfile

import pytest
import torch
from support import vllm_cpu
from support.glm5_2_checkpoint import mtp_prefixes, shared_indexer_prefixes, tiny_glm5_2_checkpoint
from support.paths import REPO
from test_glm5_bridge import cpu_engine, no_hadamard_shim_afterwards, select_npu_engine  # noqa: F401

pytestmark = [pytest.mark.network, pytest.mark.ascend_sim, pytest.mark.usefixtures("cpu_megatron_harness")]

EXAMPLE = REPO / "examples" / "glm5_2"
PUBLISHED, LAYERS, SCALED = vllm_cpu.PUBLISHED_GLM5_2, vllm_cpu.SCALED_LAYERS, vllm_cpu.SCALED_GLM5_2
HEADS, K_DIM, V_DIM, LATENT = 4, PUBLISHED["qk_nope_head_dim"], PUBLISHED["v_head_dim"], SCALED["kv_lora_rank"]
# verl's default bucket is 2048 MB; 1 MB splits this 3 MB export into several, as a 1.5 TB one is split
BUCKET_MEGABYTES = 1
GLM52_PATCH = "VERL_VLLM_ASCEND_GLM52_PATCH"


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """(checkpoint dir, HF config) of the scaled GLM-5.2, laid out like the published checkpoint."""
    return tiny_glm5_2_checkpoint(tmp_path_factory.mktemp("glm5_2_scaled"), **SCALED)


@pytest.fixture(scope="module")
def checkpoint(scaled) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(scaled[0].glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.fixture(scope="module")
def export(scaled) -> list[tuple[str, torch.Tensor]]:
    """What verl streams to the rollout at a weight sync: the engine's get_per_tensor_param, in its order."""
    per_tensor, _ = cpu_engine(scaled[0]).get_per_tensor_param()
    return [(name, tensor.detach().cpu().clone()) for name, tensor in per_tensor]


# --- broken exports: each is a mistake a bridge could make ------------------------------------------------------------


def without(name: str):
    def broken(export):
        assert name in dict(export), name
        return [(n, t) for n, t in export if n != name]

    return broken


def with_shared_layer_indexer(export):
    """Layer 3 is shared: the published checkpoint and vllm-ascend's model have no indexer there."""
    wq_b = dict(export)["model.layers.2.self_attn.indexer.wq_b.weight"]
    return [*export, ("model.layers.3.self_attn.indexer.wq_b.weight", wq_b.clone())]


def with_k_and_v_swapped(export):
    """kv_b_proj with each head's V rows before its K rows (K 192, V 256 per head: the shape does not change)."""

    def swapped(tensor):
        k, v = tensor.view(HEADS, K_DIM + V_DIM, LATENT).split([K_DIM, V_DIM], dim=1)
        return torch.cat([v, k], dim=1).reshape(tensor.shape)

    return [(n, swapped(t) if n.endswith("kv_b_proj.weight") else t) for n, t in export]


# name -> (the breakage, what problems() reports for it). A list ending in "..." gives the first lines only: the sync
# stops at an error there, and the buckets and process_weights_after_loading it never reaches leave more wrong.
BROKEN = {
    "missing-indexer-weights-proj": (
        without("model.layers.6.self_attn.indexer.weights_proj.weight"),
        ["model.layers.6.self_attn.indexer.wk_weights_proj.weight: never loaded, NaN in 128 of 8320"],
    ),
    "missing-expert-down-proj": (
        without("model.layers.4.mlp.experts.2.down_proj.weight"),
        ["model.layers.4.mlp.experts.w2_weight: never loaded, NaN in 3072 of 12288"],
    ),
    "shared-layer-indexer-sent": (
        with_shared_layer_indexer,
        # vllm-ascend's model hands vLLM's decoder its names without "model.": it has no such parameter
        [
            "the sync raised KeyError: 'layers.3.self_attn.indexer.wq_b.weight' at "
            "model.layers.3.self_attn.indexer.wq_b.weight",
            "...",
        ],
    ),
    "k-and-v-swapped": (
        with_k_and_v_swapped,
        [
            f"model.layers.{i}.self_attn.{w}: differs from vLLM's load of the checkpoint"
            for i in range(LAYERS)
            for w in ("kv_b_proj.weight", "mla_attn.mla_attn.impl.W_UK_T", "mla_attn.mla_attn.impl.W_UV")
        ],
    ),
}


@pytest.fixture(scope="module")
def vllm_sources():

    return vllm_cpu.sources()


@pytest.fixture(scope="module")
def rollout(vllm_sources, scaled, export, tmp_path_factory) -> dict:
    """Two rollout processes, run side by side: the example's environment (verl's GLM-5.2 patch on) with the export
    synced twice into one model, each broken export into a fresh model, and the reference; and the export once
    without verl's GLM-5.2 patch."""

    from verl_npu.envfile import env_file_variables

    work = tmp_path_factory.mktemp("vllm")
    exports = {"export": export, **{name: breaking(export) for name, (breaking, _) in BROKEN.items()}}
    for name, tensors in exports.items():
        torch.save(tensors, work / f"{name}.pt")
    example_env = {GLM52_PATCH: env_file_variables(str(EXAMPLE / "glm5_2.env"))[GLM52_PATCH]}
    common = {"checkpoint": str(scaled[0]), "bucket_megabytes": BUCKET_MEGABYTES}
    cases = [
        {"name": name, "export": str(work / f"{name}.pt"), "syncs": 2 if name == "export" else 1} for name in exports
    ]
    runs = {
        "example": {**common, "env": example_env, "cases": cases, "reference": True},
        "without-glm52-patch": {**common, "env": {GLM52_PATCH: "0"}, "cases": cases[:1], "reference": False},
    }
    started = {name: vllm_cpu.launch(vllm_sources, request, work / name) for name, request in runs.items()}
    return {name: vllm_cpu.collect(process, work / name) for name, process in started.items()}


@pytest.fixture(scope="module")
def reference(rollout) -> dict[str, torch.Tensor]:
    """vLLM's own loader over the checkpoint, into the same model."""
    return torch.load(rollout["example"]["reference"]["weights"])


def weights(rollout, case: str, run: str = "example") -> dict[str, torch.Tensor]:
    return torch.load(rollout[run]["cases"][case]["weights"])


def problems(case: dict, loaded: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> list[str]:
    """What is wrong with a synced model, compared with vLLM's load of the checkpoint ([] when nothing is)."""
    found = []
    if case["error"] is not None:
        found.append(f"the sync raised {case['error']['chain'][0]} at {case['error']['loading']}")
    if set(loaded) != set(reference):
        found.append(f"other weights than the reference's: {sorted(set(loaded) ^ set(reference))}")
    for name in sorted(set(loaded) & set(reference)):
        ours, theirs = loaded[name], reference[name]
        if ours.is_floating_point() and (nan := int(ours.isnan().sum())):
            found.append(f"{name}: never loaded, NaN in {nan} of {ours.numel()}")
        elif (ours.shape, ours.dtype) != (theirs.shape, theirs.dtype):
            found.append(f"{name}: {ours.dtype}{list(ours.shape)}, the reference's {theirs.dtype}{list(theirs.shape)}")
        elif not torch.equal(ours.view(-1).view(torch.uint8), theirs.view(-1).view(torch.uint8)):
            found.append(f"{name}: differs from vLLM's load of the checkpoint")
    return found


def test_the_scaled_model_keeps_glm5_2s_architecture(scaled, checkpoint):
    config = scaled[1]
    assert config.indexer_types == ["full", "full", "full", "shared", "shared", "shared", "full", "shared"]
    assert (config.index_topk_freq, config.index_skip_topk_offset) == (4, 3)
    assert config.rope_interleave and config.indexer_rope_interleave
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (192, 64, 256)
    assert (config.scoring_func, config.topk_method, config.n_shared_experts) == ("sigmoid", "noaux_tc", 1)
    assert config.first_k_dense_replace == 3 and config.num_nextn_predict_layers == 1
    assert checkpoint["model.layers.3.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert "model.layers.8.eh_proj.weight" in checkpoint  # the MTP layer, as published


# --- the rollout's model is vllm-ascend's GLM-5.2 ---------------------------------------------------------------------


def test_the_rollout_builds_glm5_2_the_way_vllm_ascend_does(rollout, scaled, reference):
    example = rollout["example"]
    assert example["platform"] == "NPUPlatform"
    modules = example["modules"]
    # vllm-ascend's subclass (its patch_deepseek_mtp) of vLLM's GLM-5 model: loads through vLLM's AutoWeightsLoader
    assert example["model_bases"][:2] == [
        "vllm_ascend.patch.worker.patch_deepseek_mtp.AscendGlmMoeDsaForCausalLM",
        "vllm.model_executor.models.deepseek_v2.GlmMoeDsaForCausalLM",
    ]
    attention = "model.layers.0.self_attn"
    assert modules[f"{attention}.mla_attn"] == "vllm_ascend.ops.mla.AscendMultiHeadLatentAttention"
    assert modules[f"{attention}.mla_attn.mla_attn.impl"] == "vllm_ascend.attention.sfa_v1.AscendSFAImpl"
    assert modules[f"{attention}.q_b_proj"] == "vllm_ascend.ops.linear.AscendColumnParallelLinear"
    assert modules["model.layers.3.mlp.experts"] == "vllm_ascend.ops.fused_moe.fused_moe.AscendFusedMoE"
    assert modules["model.layers.2.mlp"] == "vllm.model_executor.models.deepseek_v2.DeepseekV2MLP"  # dense first
    config = scaled[1]
    with_indexer = {int(n.split(".")[2]) for n in modules if n.endswith(".self_attn.indexer")}
    assert with_indexer == {i for i, kind in enumerate(config.indexer_types) if kind == "full"} == {0, 1, 2, 6}
    assert not [n for n in modules if n.startswith(f"model.layers.{LAYERS}.")]  # the MTP layer is not built
    # verl's GLM-5.2 patch keeps kv_b_proj after SFA absorbed it (the next sync loads it again)
    assert reference["model.layers.0.self_attn.kv_b_proj.weight"].shape == (HEADS * (K_DIM + V_DIM), LATENT)


def fact_parameter(name: str) -> str:
    """The vLLM parameter a checkpoint name loads into, by the recorded facts: a fused projection
    (STACKED_PARAMETERS), FusedMoE's expert tensors (EXPERT_PARAMETERS), else the name itself."""
    from verl_npu.contracts.vllm import EXPERT_PARAMETERS, STACKED_PARAMETERS

    if expert := re.search(r"experts\.\d+\.(gate_proj|up_proj|down_proj)\.", name):
        return name[: expert.start()] + EXPERT_PARAMETERS[expert[1]] + name[expert.end() :]
    for parameter, part, _ in STACKED_PARAMETERS:
        if part in name:
            return name.replace(part, parameter)
    return name


def fact_parameters(config) -> set[str]:
    """The parameters vLLM builds for ``config`` under vllm-ascend, by the recorded facts."""
    from verl_npu.contracts import vllm
    from verl_npu.contracts.vllm_ascend import MLA_PARAMETERS, layers_without_indexer

    names = set(vllm.MODEL_PARAMETERS)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        names |= {layer + n for n in vllm.DECODER_LAYER_NORMS} | {f"{layer}self_attn.{n}" for n in MLA_PARAMETERS}
        if i not in layers_without_indexer(config):
            names |= {f"{layer}self_attn.indexer.{n}" for n in vllm.INDEXER_PARAMETERS}
        if i < config.first_k_dense_replace:
            names |= {f"{layer}mlp.{n}" for n in vllm.MLP_PARAMETERS}
            continue
        names |= {f"{layer}mlp.{n}" for n in vllm.MOE_PARAMETERS} | {f"{layer}mlp.gate.e_score_correction_bias"}
        names |= {f"{layer}mlp.shared_experts.{n}" for n in vllm.MLP_PARAMETERS}
    return names


def test_the_recorded_vllm_facts_describe_the_model_vllm_builds(reference, scaled, export):
    """verl_npu/contracts/vllm.py and vllm_ascend.py record, fact by fact (each checked against the sources for drift),
    which parameters vLLM builds for GLM-5.2 and where each checkpoint name loads: the model built from those
    sources has exactly those parameters, and the export's names map onto all of them."""
    built = {n for n in reference if ".impl." not in n}
    assert built == fact_parameters(scaled[1])
    assert {fact_parameter(name) for name, _ in export} == built


# --- the export, synced ----------------------------------------------------------------------------------------------


def test_the_export_is_the_checkpoint_without_mtp_layer_and_shared_indexers(export, checkpoint, scaled):
    """The trained tensors, under the checkpoint's names, in BF16 (the router's score-correction bias stays fp32)."""
    config = scaled[1]
    sent = dict(export)
    assert len(sent) == len(export)  # no name twice
    assert set(sent) == {n for n in checkpoint if not n.startswith(mtp_prefixes(config))}
    assert not [n for n in sent if n.startswith(shared_indexer_prefixes(config))]
    for name, tensor in sent.items():
        assert tensor.dtype == checkpoint[name].dtype and torch.equal(tensor, checkpoint[name]), name


def test_each_sync_hands_load_weights_the_whole_export_bucket_by_bucket(rollout, export):
    """Every sync hands load_weights all of the export, bucket by bucket (several here), in its dtypes."""
    calls = rollout["example"]["cases"]["export"]["load_weights_calls"]
    sent = [(name, str(tensor.dtype).removeprefix("torch.")) for name, tensor in export]
    per_sync = len(calls) // 2
    assert per_sync >= 3 and len(calls) == 2 * per_sync
    for sync in (calls[:per_sync], calls[per_sync:]):
        assert [pair for bucket in sync for pair in map(tuple, bucket)] == sent


def test_every_vllm_weight_is_loaded_and_equals_vllms_load_of_the_checkpoint(rollout, reference):
    """After two syncs into a model set to NaN before each: no NaN anywhere, and every parameter and every weight the
    attention derives from kv_b_proj, byte for byte, what vLLM's own loader makes of the checkpoint."""
    case = rollout["example"]["cases"]["export"]
    assert problems(case, weights(rollout, "export"), reference) == []


def test_the_reference_is_the_checkpoint(reference, checkpoint):
    """What the comparison stands on: tensors vLLM keeps as the checkpoint has them are the checkpoint's."""
    kept_as_is = [n for n in checkpoint if n in reference]
    assert len(kept_as_is) >= 80  # norms, embeddings, q_b/kv_b/o projections, indexer wq_b and k_norm, routers
    for name in kept_as_is:
        assert torch.equal(reference[name], checkpoint[name].to(reference[name].dtype)), name


def test_process_weights_after_loading_absorbed_k_and_v_from_the_synced_kv_b_proj(rollout):
    """vllm-ascend's SFA splits each head's kv_b_proj rows 192 (K) / 256 (V) into its absorbed weights."""
    synced = weights(rollout, "export")
    for i in range(LAYERS):
        prefix = f"model.layers.{i}.self_attn."
        kv = synced[prefix + "kv_b_proj.weight"].view(HEADS, K_DIM + V_DIM, LATENT)
        assert torch.equal(synced[prefix + "mla_attn.mla_attn.impl.W_UK_T"], kv[:, :K_DIM])
        assert torch.equal(synced[prefix + "mla_attn.mla_attn.impl.W_UV"], kv[:, K_DIM:].transpose(1, 2))


@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_broken_export_fails_naming_what_went_wrong(rollout, reference, broken):
    case = rollout["example"]["cases"][broken]
    found = problems(case, weights(rollout, broken), reference)
    expected = BROKEN[broken][1]
    if expected[-1] == "...":
        assert found[: len(expected) - 1] == expected[:-1] and len(found) >= len(expected), found
    else:
        assert found == expected


def test_without_verls_glm52_patch_a_weight_sync_cannot_load_kv_b_proj(rollout):
    """vllm-ascend's SFA disposes of kv_b_proj once it absorbed it (at rollout start, over the dummy weights): every
    weight sync then fails on it. examples/glm5_2/glm5_2.env sets VERL_VLLM_ASCEND_GLM52_PATCH, whose fix keeps it."""
    case = rollout["without-glm52-patch"]["cases"]["export"]
    assert case["error"] is not None and case["error"]["chain"][0] == "AssertionError: "
    assert case["error"]["loading"] == "model.layers.0.self_attn.kv_b_proj.weight"
    assert "assert param_data.shape == loaded_weight.shape" in case["error"]["traceback"]
    synced = weights(rollout, "export", run="without-glm52-patch")
    assert synced["model.layers.0.self_attn.kv_b_proj.weight"].numel() == 0  # disposed


# --- the stand-ins ---------------------------------------------------------------------------------------------------


def test_the_format_cast_stand_in_has_torch_npus_signature():
    """torch_npu.npu_format_cast, the one operator the sync path runs (vllm-ascend casts weights after loading), has
    the signature of the pinned torch-npu wheel."""
    import inspect

    from support import fake_torch_npu
    from support.pypi import download

    from verl_npu.stack import load_stack

    version = load_stack().packages["torch-npu"].version
    wheel = download("torch-npu", lambda name: name.endswith(f"-{version}-cp312-cp312-manylinux_2_28_aarch64.whl"))
    with zipfile.ZipFile(wheel) as archive:
        schemas = archive.read("torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml").decode()
    (schema,) = re.findall(r"func: (npu_format_cast\(Tensor self, int acl_format.*?\)) -> Tensor", schemas)
    assert schema == "npu_format_cast(Tensor self, int acl_format, *, int? customize_dtype=None, int? input_dtype=None)"
    ours = inspect.signature(fake_torch_npu.npu_format_cast)
    assert str(ours) == "(self, acl_format, *, customize_dtype=None, input_dtype=None)"
