"""GLM-5.2 through verl-npu's GLM-5 bridge and verl's engine, on the CPU harness.

GLM-5.2's published checkpoint (tests_npu/support/glm5_2_checkpoint.py writes a tiny one) has no
indexer tensors on its "shared" DSA layers and an MTP layer after the decoder, and ships as bf16 and
as FP8 (e4m3, 128x128 block scales). Checked here:

* loading: every megatron parameter is its checkpoint tensor, shared layers have no indexer
  parameters, and neither their (absent) indexer tensors nor the MTP layer's are read; the MTP layer
  is said once per load;
* FP8: the checkpoint loads to the dequantised bf16 values exactly, with or without an index file;
* saving an HF checkpoint: every trained tensor is written although the loaded index lists tensors the export never
  yields (the MTP layer, an FP8 release's block scales), the index lists exactly what was written, and a model loaded
  from FP8 saves bf16 weights with a config that does not claim FP8;
* the rollout: what ``get_per_tensor_param`` streams to vLLM is the checkpoint's trained tensors (no MTP
  layer, no indexer on shared layers); that vLLM loads it, every parameter, into vllm-ascend's model is
  executed in tests_npu/engine/test_vllm_load_weights.py (network and ascend_sim tiers);
* the config: GLM-5.2's router dtype, RoPE theta and 1M positions (examples/glm5_2/config.json).
"""

from __future__ import annotations

import collections
import json
import logging
from pathlib import Path

import pytest
import torch
from support.glm5_2_checkpoint import (
    SCALE_SUFFIX,
    dequantize_fp8_blocks,
    mtp_prefixes,
    shared_indexer_prefixes,
    tiny_glm5_2_checkpoint,
)
from support.paths import REPO
from test_glm5_bridge import cpu_engine, gpt_of, hf_names_of, no_hadamard_shim_afterwards, select_npu_engine  # noqa: F401

pytestmark = pytest.mark.usefixtures("cpu_megatron_harness")

INDEXER = "self_attention.core_attention.indexer."


def load_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.fixture(scope="module")
def glm5_2(tmp_path_factory):
    """(checkpoint dir, HF config) of the bf16 tiny GLM-5.2."""
    return tiny_glm5_2_checkpoint(tmp_path_factory.mktemp("glm5_2"))


@pytest.fixture(scope="module")
def checkpoint(glm5_2) -> dict[str, torch.Tensor]:
    return load_checkpoint(glm5_2[0])


@pytest.fixture(scope="module")
def trained(glm5_2, checkpoint) -> set[str]:
    """The checkpoint tensors RL trains: all but the MTP layer's."""
    return {name for name in checkpoint if not name.startswith(mtp_prefixes(glm5_2[1]))}


class ReadRecorder:
    """Records every tensor name read from a checkpoint file: through mbridge's reader, or through the engine's
    (verl_npu.engine.bridges.fast_read: ``read_tensors``, which the bridge's readers call, and ``TensorReads``, which
    its loader reads with)."""

    def __init__(self):
        self.names: list[str] = []

    def install(self, monkeypatch):
        from mbridge.core.safetensor_io import SafeTensorIO

        from verl_npu.engine.bridges import fast_read

        original = SafeTensorIO.load_some_hf_weight
        original_read = fast_read.read_tensors

        def load_some_hf_weight(io, hf_weight_names):
            self.names.extend(hf_weight_names)
            return original(io, hf_weight_names)

        def read_tensors(path, names, threads=fast_read.READ_THREADS):
            names = list(names)
            self.names.extend(names)
            return original_read(path, names, threads)

        original_reads = fast_read.TensorReads.__init__

        def tensor_reads(reads, reader, names, uses=None, device=None):
            names = list(names)
            self.names.extend(names)
            original_reads(reads, reader, names, uses, device)

        monkeypatch.setattr(SafeTensorIO, "load_some_hf_weight", load_some_hf_weight)
        monkeypatch.setattr(fast_read, "read_tensors", read_tensors)
        monkeypatch.setattr(fast_read.TensorReads, "__init__", tensor_reads)
        return self


@pytest.fixture(scope="module")
def engine_and_reads(glm5_2):
    with pytest.MonkeyPatch.context() as patch:
        reads = ReadRecorder().install(patch)
        engine = cpu_engine(glm5_2[0])
    return engine, reads.names


@pytest.fixture(scope="module")
def engine(engine_and_reads):
    return engine_and_reads[0]


@pytest.fixture(scope="module")
def exported(engine) -> dict[str, torch.Tensor]:
    """What verl streams to the rollout after a training step."""
    per_tensor, _ = engine.get_per_tensor_param()
    return {name: tensor.detach().cpu().clone() for name, tensor in per_tensor}


# --- the fixture is the published layout -------------------------------------------------------------


def test_the_tiny_checkpoint_is_laid_out_like_the_published_one(glm5_2, checkpoint):
    path, config = glm5_2
    assert config.indexer_types == ["full", "full", "full", "shared", "shared", "shared", "full", "shared"]
    assert (path / "model.safetensors.index.json").is_file()
    assert not [n for n in checkpoint if n.startswith(shared_indexer_prefixes(config))]
    assert {n for n in checkpoint if ".indexer." in n and n.startswith(tuple(f"model.layers.{i}." for i in (0, 6)))}
    mtp = [n for n in checkpoint if n.startswith("model.layers.8.")]
    assert "model.layers.8.eh_proj.weight" in mtp and "model.layers.8.self_attn.indexer.wq_b.weight" in mtp
    assert {t.dtype for n, t in checkpoint.items() if not n.endswith("e_score_correction_bias")} == {torch.bfloat16}


# --- loading -----------------------------------------------------------------------------------------


def test_shared_layers_have_no_indexer_parameters_and_there_is_no_mtp(engine, glm5_2):
    config = glm5_2[1]
    gpt = gpt_of(engine)
    names = [name for name, _ in gpt.named_parameters()]
    for layer, kind in enumerate(config.indexer_types):
        indexer = [n for n in names if n.startswith(f"decoder.layers.{layer}.{INDEXER}")]
        assert bool(indexer) == (kind == "full"), (layer, kind, indexer)
    assert not [n for n in names if "mtp" in n] and not getattr(gpt, "mtp_process", False)
    assert not engine.bridge.config.mtp_num_layers


def test_every_megatron_weight_is_its_checkpoint_tensor(engine, checkpoint, trained):
    gpt = gpt_of(engine)
    names = hf_names_of(engine.bridge, gpt)
    used = collections.Counter(n for hf in names.values() for n in hf)
    assert set(used) == trained, f"unmapped {trained - set(used)}, unknown {set(used) - trained}"
    assert set(used.values()) == {1}, f"used twice: {[n for n, c in used.items() if c > 1]}"
    state = gpt.state_dict()
    for local, hf in names.items():  # a parameter that load_weights skipped keeps its random init
        expected = engine.bridge._weight_to_mcore_format(local, [checkpoint[n] for n in hf])
        assert torch.equal(state[local], expected.to(state[local].dtype)), local


def test_loading_reads_neither_shared_indexers_nor_the_mtp_layer(engine_and_reads, glm5_2, trained):
    """The published checkpoint has no shared-layer indexer tensors: the load must not ask for them (it would
    fail), nor read the MTP layer it does not build."""
    _, reads = engine_and_reads
    config = glm5_2[1]
    assert not [n for n in reads if n.startswith(shared_indexer_prefixes(config) + mtp_prefixes(config))]
    assert set(reads) == trained


def test_the_mtp_layer_is_said_once_per_load(engine, glm5_2, caplog, monkeypatch):
    from verl_npu.engine.bridges import glm5

    reads = ReadRecorder().install(monkeypatch)
    with caplog.at_level(logging.INFO, logger=glm5.__name__):
        engine.bridge.load_weights(engine.module, str(glm5_2[0]))  # what verl's engine does at init
    said = [r for r in caplog.records if r.name == glm5.__name__]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert said[0].levelno == logging.WARNING
    assert "the checkpoint's MTP layer(s) model.layers.8.* are neither built nor loaded" in said[0].getMessage()
    assert "RL does not train them" in said[0].getMessage()
    assert reads.names and not [n for n in reads.names if n.startswith("model.layers.8.")]


# --- FP8 ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 1], ids=["index", "no-index"])
def fp8_checkpoint(request, tmp_path_factory):
    """The FP8 release of the same weights (same seed): sharded with an index file, or one file without."""
    path, config = tiny_glm5_2_checkpoint(tmp_path_factory.mktemp("glm5_2_fp8"), fp8=True, shards=request.param)
    return path, config, load_checkpoint(path)


def dequantised(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint as bf16: each FP8 weight times its 128x128 block's scale (DeepSeek-V3's format)."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        out[name] = tensor if scale is None else dequantize_fp8_blocks(tensor, scale)
    return out


def test_the_fp8_checkpoint_is_block_scaled_e4m3(fp8_checkpoint, checkpoint):
    _, config, tensors = fp8_checkpoint
    assert config.quantization_config["weight_block_size"] == [128, 128]
    assert config.quantization_config["fmt"] == "e4m3" and config.quantization_config["quant_method"] == "fp8"
    gate = tensors["model.layers.0.mlp.gate_proj.weight"]  # 160 x 64: two row blocks, the second partial
    assert gate.dtype == torch.float8_e4m3fn and tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (
        2,
        1,
    )
    assert tensors["model.layers.1.self_attn.indexer.weights_proj.weight"].dtype == torch.bfloat16  # kept bf16
    close = dequantised(tensors)["model.layers.0.mlp.gate_proj.weight"].float()
    bf16 = checkpoint["model.layers.0.mlp.gate_proj.weight"].float()
    assert (close - bf16).abs().max() <= 0.07 * bf16.abs().max()  # e4m3's 3 mantissa bits


def test_the_bridge_reads_an_fp8_checkpoint_as_the_dequantised_bf16(fp8_checkpoint):
    from verl_npu.engine.bridges.fp8_safetensors import BlockFP8SafeTensorIO
    from verl_npu.engine.bridges.glm5 import GLM5Bridge

    path, config, tensors = fp8_checkpoint
    io = GLM5Bridge(config, dtype=torch.bfloat16)._get_safetensor_io(str(path))
    assert isinstance(io, BlockFP8SafeTensorIO)
    expected = dequantised(tensors)
    read = io.load_some_hf_weight(sorted(expected))
    assert set(read) == set(expected)
    for name, tensor in read.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    assert sum(n.endswith(SCALE_SUFFIX) for n in tensors) >= 8 * 5  # attention, indexer and MLP weights were FP8


def test_mbridges_fp8_reader_cannot_read_a_checkpoint_without_an_index_file(tmp_path):
    """Why the bridge has its own reader (see verl_npu.engine.bridges.fp8_safetensors): mbridge 0.15.1's
    DequantFP8SafeTensorIO looks every tensor up in model.safetensors.index.json (and dequantises with a Triton
    kernel, not on the CPU); BlockFP8SafeTensorIO reads the same one-file checkpoint."""
    from mbridge.models.ext.deepseek_v3.dequant_fp8_safetensor_io import DequantFP8SafeTensorIO
    from safetensors.torch import save_file
    from support.glm5_2_checkpoint import quantize_fp8_blocks

    from verl_npu.engine.bridges.fp8_safetensors import BlockFP8SafeTensorIO

    weight = torch.randn(200, 130).to(torch.bfloat16)
    codes, scale = quantize_fp8_blocks(weight)
    save_file({"w.weight": codes, "w.weight_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    default_dtype = torch.get_default_dtype()
    try:
        with pytest.raises(KeyError, match=r"w\.weight"):
            DequantFP8SafeTensorIO(str(tmp_path)).load_some_hf_weight(["w.weight"])
    finally:
        torch.set_default_dtype(default_dtype)  # mbridge's reader sets bf16 and fails before setting it back
    (read,) = BlockFP8SafeTensorIO(str(tmp_path)).load_some_hf_weight(["w.weight"]).values()
    assert torch.equal(read, dequantize_fp8_blocks(codes, scale)) and scale.shape == (2, 2)


def test_a_missing_block_scale_is_an_error_not_raw_fp8_codes(tmp_path):
    from safetensors.torch import save_file

    from verl_npu.engine.bridges.fp8_safetensors import BlockFP8SafeTensorIO

    codes = torch.randn(130, 70).to(torch.float8_e4m3fn)
    save_file({"w.weight": codes, "other.weight_scale_inv": torch.ones(1, 1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no _scale_inv for \['w.weight'\]"):
        BlockFP8SafeTensorIO(str(tmp_path)).load_some_hf_weight(["w.weight"])
    save_file({"w.weight": codes, "w.weight_scale_inv": torch.ones(1, 1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"needs a scale of shape \(2, 1\)"):
        BlockFP8SafeTensorIO(str(tmp_path)).load_some_hf_weight(["w.weight"])


def test_an_fp8_checkpoint_loads_to_the_dequantised_values_exactly(engine, fp8_checkpoint, glm5_2):
    path, _, tensors = fp8_checkpoint
    gpt = gpt_of(engine)
    names = hf_names_of(engine.bridge, gpt)
    expected = dequantised(tensors)
    try:
        engine.bridge.load_weights(engine.module, str(path))
        state = gpt.state_dict()
        for local, hf in names.items():
            want = engine.bridge._weight_to_mcore_format(local, [expected[n] for n in hf])
            assert torch.equal(state[local], want.to(state[local].dtype)), local
    finally:
        engine.bridge.load_weights(engine.module, str(glm5_2[0]))  # the other tests' bf16 weights


# --- saving an HF checkpoint ----------------------------------------------------------------------------


def saved_checkpoint(engine, out: Path) -> tuple[dict[str, torch.Tensor], dict | None, dict]:
    """The engine's model saved as an HF checkpoint (mbridge's save_weights through the bridge): its tensors, its
    index (None: one file) and its config.json."""
    engine.bridge.save_weights(engine.module, str(out))
    index_file = out / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else None
    return load_checkpoint(out), index, json.loads((out / "config.json").read_text())


def assert_index_lists_exactly_the_saved_tensors(out: Path, saved: dict[str, torch.Tensor], index: dict) -> None:
    from safetensors import safe_open

    assert set(index["weight_map"]) == set(saved)
    for filename in set(index["weight_map"].values()):
        with safe_open(str(out / filename), framework="pt") as f:
            assert {n for n, where in index["weight_map"].items() if where == filename} == set(f.keys()), filename
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in saved.values())
    assert not list(out.glob("*.partial"))


def test_a_saved_checkpoint_holds_every_trained_tensor_although_the_mtp_layer_shares_its_shards(
    engine, exported, trained, glm5_2, tmp_path
):
    """The loaded checkpoint's index lists the MTP layer beside trained tensors; mbridge's saver waited for it
    (verl_npu/engine/bridges/hf_save.py) and never wrote those shards."""
    index = json.loads((glm5_2[0] / "model.safetensors.index.json").read_text())["weight_map"]
    mtp_files = {index[n] for n in index if n.startswith(mtp_prefixes(glm5_2[1]))}
    assert any(index[n] in mtp_files for n in trained)  # the case: a shard holds both
    saved, saved_index, _ = saved_checkpoint(engine, tmp_path)
    assert set(saved) == trained
    for name, tensor in saved.items():
        assert torch.equal(tensor, exported[name]), name
    assert_index_lists_exactly_the_saved_tensors(tmp_path, saved, saved_index)


def test_mbridges_own_saver_loses_the_shards_that_hold_an_unexported_tensor(engine, trained, glm5_2, tmp_path):
    """Why the bridge's readers save with verl_npu.engine.bridges.hf_save: mbridge 0.15.1's SafeTensorIO, given
    the same export, writes fewer tensors than were trained (and warns)."""
    from mbridge.core.safetensor_io import SafeTensorIO

    theirs = SafeTensorIO(str(glm5_2[0]))
    with pytest.warns(UserWarning, match="Some weights are not saved"):
        theirs.save_hf_weight(engine.bridge.export_weights(engine.module), str(tmp_path), [])
    assert set(load_checkpoint(tmp_path)) < trained


def test_a_save_after_an_fp8_load_writes_the_bf16_weights_without_the_fp8_config(
    engine, fp8_checkpoint, glm5_2, trained, tmp_path, monkeypatch
):
    """Loaded from the FP8 release, the model saves its dequantised bf16 weights: every trained tensor, no block
    scale, and a config without ``quantization_config`` (a loader would take the bf16 weights for FP8 codes)."""
    path, fp8_config, tensors = fp8_checkpoint
    expected = dequantised(tensors)
    # an engine built from the FP8 release has its config (the bridge's hf_config), quantization_config included
    monkeypatch.setattr(engine.bridge.hf_config, "quantization_config", fp8_config.quantization_config, raising=False)
    try:
        engine.bridge.load_weights(engine.module, str(path))
        saved, index, config = saved_checkpoint(engine, tmp_path)
    finally:
        engine.bridge.load_weights(engine.module, str(glm5_2[0]))  # the other tests' bf16 weights
    assert set(saved) == trained and not [n for n in saved if n.endswith(SCALE_SUFFIX)]
    for name, tensor in saved.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    assert "quantization_config" not in config and config["model_type"] == "glm_moe_dsa"
    assert engine.bridge.hf_config.quantization_config["quant_method"] == "fp8"  # the bridge's own config keeps it
    if index is not None:
        assert_index_lists_exactly_the_saved_tensors(tmp_path, saved, index)


# --- the rollout: what the engine exports --------------------------------------------------------------


def test_export_gives_back_every_trained_tensor_and_nothing_else(exported, checkpoint, trained, glm5_2):
    """verl's weight sync (get_per_tensor_param): the checkpoint's names, layouts and values, no MTP layer
    and, on shared layers, no indexer (the published checkpoint and vLLM have none)."""
    assert set(exported) == trained
    assert not [n for n in exported if n.startswith(shared_indexer_prefixes(glm5_2[1]))]
    for name, tensor in exported.items():
        assert torch.equal(tensor, checkpoint[name].to(tensor.dtype)), name


def rollout_warnings(config, caplog, calls: int = 3) -> list[str]:
    from verl_npu.engine.bridges import glm5

    caplog.clear()
    bridge = glm5.GLM5Bridge(config, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger=glm5.__name__):
        for _ in range(calls):  # export_weights runs it at every weight sync
            bridge._warn_if_the_rollout_builds_another_model()
    return [r.getMessage() for r in caplog.records if r.name == glm5.__name__]


def config_without(config, *fields: str, **changes):
    from transformers import GlmMoeDsaConfig

    values = {k: v for k, v in config.to_dict().items() if k not in fields}
    return GlmMoeDsaConfig.from_dict({**values, **changes})


def test_a_config_where_vllm_builds_other_indexers_or_moe_layers_is_logged_once(glm5_2, caplog):
    """vLLM reads other fields than transformers and the bridge: top-k reuse from index_topk_freq /
    index_skip_topk_offset (vllm-ascend's no-indexer rule) and MoE layers from first_k_dense_replace."""
    from transformers import GlmMoeDsaConfig

    assert rollout_warnings(glm5_2[1], caplog) == []  # the tiny GLM-5.2 agrees with itself
    example = json.loads((REPO / "examples" / "glm5_2" / "config.json").read_text())
    assert rollout_warnings(GlmMoeDsaConfig.from_dict(example), caplog) == []  # so does the example's architecture
    # indexer_types alone: vllm-ascend keeps an indexer (never sent) on the layers the bridge shares
    (said,) = rollout_warnings(config_without(glm5_2[1], "index_topk_freq", "index_skip_topk_offset"), caplog)
    assert "marks layers [3, 4, 5, 7] shared" in said and "no indexer on layers []" in said
    dense_two = ["dense", "dense"] + ["sparse"] * 6
    (said,) = rollout_warnings(config_without(glm5_2[1], mlp_layer_types=dense_two), caplog)
    assert "mlp_layer_types makes layers [2, 3, 4, 5, 6, 7] MoE" in said and "[1, 2, 3, 4, 5, 6, 7]" in said
    (said,) = rollout_warnings(config_without(glm5_2[1], "first_k_dense_replace"), caplog)
    assert "no first_k_dense_replace" in said and "add first_k_dense_replace=1" in said


# --- GLM-5.2's config ---------------------------------------------------------------------------------


def test_glm5_2s_router_dtype_rope_theta_and_million_positions_reach_megatron():
    from transformers import GlmMoeDsaConfig

    from verl_npu.engine.bridges.glm5 import GLM5Bridge

    published = json.loads((REPO / "examples" / "glm5_2" / "config.json").read_text())
    assert published["moe_router_dtype"] == "float32" and published["rope_parameters"]["rope_theta"] == 8e6
    bridge = GLM5Bridge(GlmMoeDsaConfig(**published), dtype=torch.bfloat16)
    config, gpt_args = bridge.config, bridge._get_gptmodel_args()
    assert config.moe_router_dtype == "fp32"
    assert config.rotary_base == 8e6 and gpt_args["rotary_base"] == 8e6
    assert gpt_args["max_sequence_length"] == 1048576
    assert config.num_layers == 78 and not config.mtp_num_layers  # the MTP layer is not built
