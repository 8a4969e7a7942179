"""Preflight's start-up estimate: the checkpoint bytes each node loads, the read rate, the HCCL timeouts it needs.

Hand-computed byte counts for a dense model and for the GLM-5.2 example's layout, where the engine's
prefetch runs (it adds no bytes), FP8 block checkpoints, a local safetensors checkpoint counted from its index and
headers, every verdict on both sides of its limit, bad option and environment values, and the CLI on the example
(docs/preflight_startup.md).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from support.paths import REPO

from verl_npu.checks import FAIL, OK, WARN
from verl_npu.inputs import InputError
from verl_npu.parallelism import Parallelism
from verl_npu.preflight import run_preflight
from verl_npu.preflight.model_shape import ModelShape
from verl_npu.preflight.startup import (
    ENGINE_SHARE_OF_DISK_RATE,
    GB,
    PREFETCH_SHARE_OF_AVAILABLE,
    CheckpointError,
    NodeRead,
    StartupEstimate,
    Storage,
    estimate_startup,
    local_checkpoint,
    model_bytes,
    node_reads,
    pre_reading_nodes,
    read_rate,
    sample_read_rate,
    timeout_checks,
)

EXAMPLE = REPO / "examples" / "glm5_2"
LAUNCH = EXAMPLE / "run_glm5_2_grpo_a3.sh"
BF16 = Storage("bf16", 2.0, 2.0)
FP8 = Storage.of({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}})

# a llama of 4 layers: attention 64*(4+2*4)*16 + 4*16*64 = 16384, MLP 3*64*128 = 24576 (both TP-split), two norms 128
DENSE = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128}  # fmt: skip
DENSE_LAYER_PARAMS = 16384 + 24576 + 128
EMBEDDING_PARAMS = 1000 * 64


def mesh(world: int, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, first=None, last=None):
    return Parallelism(
        world=world, tp=tp, pp=pp, ep=ep, etp=etp or tp, first_stage_layers=first, last_stage_layers=last
    )


@pytest.fixture(scope="module")
def dense() -> ModelShape:
    return ModelShape.from_dict(DENSE)


@pytest.fixture(scope="module")
def glm52() -> ModelShape:
    return ModelShape.from_hf(str(EXAMPLE / "config.json"))


def glm52_mesh() -> Parallelism:
    """The example's actor: TP 2, PP 8 (9 / 10 x 6 / 9 layers), CP 4, EP 64, ETP 1 on 32 nodes x 16."""
    return Parallelism(
        world=512, tp=2, pp=8, cp=4, ep=64, etp=1, sequence_parallel=True, first_stage_layers=9, last_stage_layers=9
    )


# --- bytes each node reads -----------------------------------------------------------------------------------
def test_a_dense_model_on_two_nodes_reads_one_stage_each_with_the_embedding_and_the_head(dense):
    parts = model_bytes(dense, BF16)
    assert parts.layer_non_expert == (2 * DENSE_LAYER_PARAMS,) * 4
    reads = node_reads(dense, parts, mesh(8, tp=2, pp=2), ranks_per_node=4)
    assert [r.stages for r in reads] == [(0,), (1,)]
    assert reads[0].bytes == 2 * (2 * DENSE_LAYER_PARAMS + EMBEDDING_PARAMS)  # layers 0-1 and the embedding
    assert reads[1].bytes == 2 * (2 * DENSE_LAYER_PARAMS + 64 + EMBEDDING_PARAMS)  # layers 2-3, final norm, lm_head
    assert parts.total == 2 * (4 * DENSE_LAYER_PARAMS + 2 * EMBEDDING_PARAMS + 64)


def test_a_tp_group_across_nodes_reads_its_tensors_on_rank_0s_node_and_lm_head_on_every_node(dense):
    reads = node_reads(dense, model_bytes(dense, BF16), mesh(4, tp=4), ranks_per_node=2)
    assert reads[0].bytes == 2 * (4 * DENSE_LAYER_PARAMS + 2 * EMBEDDING_PARAMS + 64)  # TP ranks 0, 1: everything
    assert reads[1].bytes == 2 * EMBEDDING_PARAMS  # TP ranks 2, 3 read lm_head only ("lm_head.weight" in its names)


def test_the_glm5_2_example_busiest_node_reads_its_stages_non_expert_tensors_and_a_quarter_of_its_experts(glm52):
    reads = node_reads(glm52, model_bytes(glm52, BF16), glm52_mesh(), ranks_per_node=16)
    assert len(reads) == 32 and [r.stages for r in reads[:5]] == [(0,)] * 4 + [(1,)]
    expert = 3 * 6144 * 2048  # gate, up, down of one routed expert
    # per MoE layer, besides the routed experts: q_b, kv_b, o (TP-split) and the shared expert ...
    tp = 2048 * 64 * 256 + 512 * 64 * (192 + 256) + 64 * 256 * 6144 + expert
    # ... and the norms, q_a / kv_a down projections, router (replicated); a full DSA layer adds its indexer
    replicated = 6144 + 6144 * 2048 + 2048 + 6144 * 576 + 512 + 6144 + 256 * 6144
    indexer = 2048 * 32 * 128 + 6144 * 128 + 2 * 128 + 6144 * 32
    # stage 1: layers 9-18, all MoE, full indexers on 10, 14, 18; its 4 nodes hold 16 EP ranks x 4 experts each
    stage1 = 10 * (tp + replicated) + 3 * indexer + 10 * 64 * expert
    busiest = max(reads, key=lambda r: r.bytes)
    assert (busiest.node, busiest.stages, busiest.bytes) == (4, (1,), 2 * stage1)
    assert 2 * stage1 == 52_461_735_424


def test_fp8_block_checkpoints_store_projections_as_one_byte_and_a_scale_per_128x128_block(dense, glm52):
    assert FP8.quantised_bytes == 1 + 4 / (128 * 128) and FP8.plain_bytes == 2
    parts = model_bytes(dense, FP8)
    assert parts.layer_non_expert[0] == 40960 * (1 + 4 / 16384) + 128 * 2  # projections quantised, norms bf16
    assert parts.embedding == parts.head == 2 * EMBEDDING_PARAMS
    glm = model_bytes(glm52, FP8)
    assert glm.layer_per_expert[3] == 3 * 6144 * 2048 + 4 * 3 * (6144 * 2048 // 16384)  # 37,748,736 + 9,216 x 4
    assert glm.layer_per_expert[0] == 0  # a dense layer has no routed experts
    assert Storage.of({"torch_dtype": "float32"}).plain_bytes == 4
    with pytest.raises(InputError, match=r"weight_block_size\[0\]=0: expected an integer from 1"):
        Storage.of({"quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 128]}})
    with pytest.raises(InputError, match=r"weight_block_size=128: expected two integers"):
        Storage.of({"quantization_config": {"quant_method": "fp8", "weight_block_size": 128}})


# --- the prefetch --------------------------------------------------------------------------------------------
def test_the_glm5_2_example_reads_its_ranks_shards_and_the_prefetch_never_runs(glm52):
    estimate, checks = estimate_startup(glm52, {}, glm52_mesh(), 16, read_gbps=1.0, checkpoint_dir=None)
    assert estimate.shard_bytes == 52_461_735_424 and estimate.checkpoint_bytes == 1_486_754_001_408
    assert estimate.pre_read_nodes == 0 and estimate.reads == "the union of its ranks' shards"  # PP 8, EP 64
    assert estimate.minimum_timeout() == 233  # ceil(2 x 52.46 GB / 0.61 GB/s + 60)
    load = next(c for c in checks if c.check == "startup.load")
    assert "each node reads the union of its ranks' shards; node 4 (stages [1]) reads the most, 52.5 GB" in load.detail
    assert "52.5 GB at 1 GB/s x 0.61" in load.detail and "= 233 s" in load.detail


def test_the_prefetch_runs_where_local_rank_0_loads_the_whole_checkpoint_and_adds_no_bytes(dense):
    parts = model_bytes(dense, BF16)
    one_stage = mesh(16, tp=2)  # PP 1, EP 1: each node's LOCAL_RANK 0 is TP rank 0 of the only stage
    assert pre_reading_nodes(one_stage, 8) == 2
    assert [r.bytes for r in node_reads(dense, parts, one_stage, 8)] == [parts.total] * 2  # whole, prefetched or not
    assert pre_reading_nodes(mesh(16, tp=16), 8) == 1  # node 1's LOCAL_RANK 0 is TP rank 8: it loads lm_head only
    assert pre_reading_nodes(mesh(16, tp=2, etp=4), 2) == 4  # expert-TP rank 0 as well: ranks 0, 4, 8, 12
    assert pre_reading_nodes(mesh(16, tp=2, pp=2), 8) == pre_reading_nodes(mesh(16, tp=2, ep=2), 8) == 0
    estimate = estimate_startup(dense, {}, one_stage, 8, read_gbps=1.0, checkpoint_dir=None)[0]
    assert estimate.shard_bytes == estimate.checkpoint_bytes == round(parts.total)
    assert estimate.reads == (
        "the union of its ranks' shards; PP=1 and EP=1: on the 2 of 2 node(s) whose LOCAL_RANK 0 loads the whole "
        "checkpoint, the engine prefetches it into host memory during the build (when it is under 0.5 of "
        "MemAvailable), overlapping the read with the build: the bytes are the same"
    )
    assert estimate.to_dict()["reads"] == estimate.reads and estimate.to_dict()["pre_read_nodes"] == 2


def test_the_constants_are_the_engines_measured_ones():
    measured = [
        json.loads((REPO / "bench" / "results" / name).read_text())["engines"]["ours"]["phases"]["load"]
        for name in ("rl_step_dense_h200.json", "rl_step_glm5_bf16_h200.json", "rl_step_glm5_fp8_h200.json")
    ]
    # the slowest of the committed runs: a timeout derived from it holds on the others
    assert math.floor(min(load["fraction_of_limit"] for load in measured) * 100) / 100 == ENGINE_SHARE_OF_DISK_RATE
    fast_read = (REPO / "verl_npu" / "engine" / "bridges" / "fast_read.py").read_text()
    assert (
        float(re.search(r"^PREFETCH_SHARE_OF_AVAILABLE = ([0-9.]+)", fast_read, re.M)[1]) == PREFETCH_SHARE_OF_AVAILABLE
    )


# --- a checkpoint on this machine ------------------------------------------------------------------------------
def write_checkpoint(directory: Path, index: dict | None = None) -> int:
    """Two tiny safetensors files; the tensors' bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"a": np.zeros((4, 8), np.float16), "b": np.zeros(16, np.float32)}, str(directory / "one.safetensors"))
    save_file({"c": np.zeros((2, 3), np.float16)}, str(directory / "two.safetensors"))
    if index is not None:
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return 4 * 8 * 2 + 16 * 4 + 2 * 3 * 2


def test_a_local_checkpoint_is_counted_from_its_index_else_its_headers(tmp_path):
    tensors = write_checkpoint(tmp_path / "headers")
    found = local_checkpoint(tmp_path / "headers")
    assert found.bytes == tensors == 140 and "headers of 2" in found.source
    write_checkpoint(tmp_path / "index", {"metadata": {"total_size": 123456}, "weight_map": {}})
    assert local_checkpoint(tmp_path / "index").bytes == 123456  # the index's word, not the files'
    mapped = {"metadata": {}, "weight_map": {"c": "two.safetensors"}}
    write_checkpoint(tmp_path / "mapped", mapped)
    assert local_checkpoint(tmp_path / "mapped").bytes == 12  # only the files the index maps
    assert local_checkpoint(tmp_path / "absent") is None
    (tmp_path / "empty").mkdir()
    assert local_checkpoint(tmp_path / "empty") is None


def test_a_broken_local_checkpoint_is_named_and_the_shape_counts_instead(tmp_path, dense):
    write_checkpoint(tmp_path / "bad", {"metadata": {"total_size": -5}})
    with pytest.raises(CheckpointError, match="total_size"):
        local_checkpoint(tmp_path / "bad")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    with pytest.raises(CheckpointError, match=r"x\.safetensors: the header is not JSON"):
        local_checkpoint(tmp_path / "junk")
    estimate, checks = estimate_startup(dense, {}, mesh(2), 2, read_gbps=1.0,
                                        checkpoint_dir=str(tmp_path / "junk"))  # fmt: skip
    assert (checks[0].check, checks[0].status) == ("startup.checkpoint", WARN)
    assert estimate.checkpoint_bytes == round(model_bytes(dense, BF16).total)


def test_a_local_checkpoints_real_bytes_are_shared_out_as_the_shape_shares_them(tmp_path, dense):
    parts = model_bytes(dense, BF16)
    write_checkpoint(tmp_path / "ckpt", {"metadata": {"total_size": round(2 * parts.total)}})
    estimate = estimate_startup(dense, {}, mesh(8, tp=2, pp=2), 4, read_gbps=1.0,
                                checkpoint_dir=str(tmp_path / "ckpt"))[0]  # fmt: skip
    assert estimate.checkpoint_bytes == round(2 * parts.total) and "metadata.total_size" in estimate.checkpoint_source
    assert estimate.shard_bytes == round(2 * 2 * (2 * DENSE_LAYER_PARAMS + 64 + EMBEDDING_PARAMS))


def test_without_the_flag_a_local_checkpoint_is_sampled_cold_on_this_host(tmp_path, dense):
    write_checkpoint(tmp_path / "ckpt")
    estimate, checks = estimate_startup(dense, {}, mesh(2), 2, read_gbps=None,
                                        checkpoint_dir=str(tmp_path / "ckpt"))  # fmt: skip
    rate = next(c for c in checks if c.check == "startup.read-rate")
    assert estimate.read_gbps > 0 and "sampled on this host" in rate.detail and "one.safetensors" in rate.detail
    assert rate.status == WARN and "under 64 MiB" in rate.fix and "--checkpoint-read-gbps" in rate.fix
    sample = sample_read_rate(tmp_path / "ckpt" / "one.safetensors", limit=100)
    assert sample.bytes == 100  # stops at the limit
    whole = sample_read_rate(tmp_path / "ckpt" / "one.safetensors")
    assert whole.bytes == (tmp_path / "ckpt" / "one.safetensors").stat().st_size


def test_without_the_flag_or_a_local_checkpoint_the_rate_is_unknown_and_no_minimum_is_guessed(dense):
    estimate, checks = estimate_startup(dense, {}, mesh(2), 2, read_gbps=None,
                                        checkpoint_dir=None)  # fmt: skip
    rate = next(c for c in checks if c.check == "startup.read-rate")
    assert rate.status == WARN and "unknown" in rate.detail and "--checkpoint-read-gbps" in rate.fix
    assert estimate.minimum_timeout() is None
    assert timeout_checks(estimate, {"HCCL_CONNECT_TIMEOUT": "600"}) == []  # range-checked, nothing to compare


# --- the rate flag ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "fast", "\u0661", "0x10"])
def test_a_bad_read_rate_is_refused_naming_the_option(bad):
    with pytest.raises(InputError, match=r"--checkpoint-read-gbps=.*expected a finite number > 0"):
        read_rate(bad)


def test_an_implausible_read_rate_warns_and_a_plausible_one_is_quoted(dense):
    assert read_rate("1.5") == 1.5 and read_rate(None) is None
    checks = estimate_startup(dense, {}, mesh(2), 2, read_gbps=60.0, checkpoint_dir=None)[1]
    assert [(c.check, c.status) for c in checks] == [("startup.read-rate", WARN), ("startup.load", OK)]
    assert "60 GB/s is above" in checks[0].detail
    checks = estimate_startup(dense, {}, mesh(2), 2, read_gbps=50.0, checkpoint_dir=None)[1]
    assert checks[0].status == OK and "--checkpoint-read-gbps 50" in checks[0].detail


# --- the timeouts ----------------------------------------------------------------------------------------------
def fixed(load_s: float = 100.0) -> StartupEstimate:
    """An estimate whose busiest node loads for ``load_s`` at 1 GB/s: minimum ceil(2 x load_s + 60)."""
    shard = round(load_s * GB * ENGINE_SHARE_OF_DISK_RATE)
    return StartupEstimate(2, 8, "bf16", 2 * shard, "test", NodeRead(0, (0,), shard), 0, 1.0, "test")


def verdicts(estimate, **env) -> dict[str, tuple[str, str]]:
    return {c.check.removeprefix("startup."): (c.status, c.detail) for c in timeout_checks(estimate, env)}


@pytest.mark.parametrize(
    ("value", "status"),
    [("259", FAIL), ("260", OK), ("2600", OK), ("2601", WARN)],
)
def test_each_timeout_fails_below_the_minimum_and_warns_over_ten_times_it(value, status):
    assert fixed().minimum_timeout() == 260
    found = verdicts(fixed(), HCCL_CONNECT_TIMEOUT=value, HCCL_EXEC_TIMEOUT=value)
    for name in ("hccl-connect-timeout", "hccl-exec-timeout"):
        assert found[name][0] == status, found[name]
        assert "260 s" in found[name][1] and "100 s to load" in found[name][1]


def test_a_failure_names_the_variable_the_value_the_minimum_its_derivation_and_the_fix():
    checks = timeout_checks(fixed(), {"HCCL_CONNECT_TIMEOUT": "300", "HCCL_EXEC_TIMEOUT": "100"})
    check = next(c for c in checks if c.status == FAIL)
    assert check.detail.startswith("HCCL_EXEC_TIMEOUT=100 s is below the 260 s the start-up needs")
    assert "61.0 GB at 1 GB/s x 0.61" in check.detail and "x 2 (safety) + 60 s" in check.detail
    where = "in the launch's environment (its env file)"
    assert check.fix == f"set HCCL_EXEC_TIMEOUT to at least 260 and at most 2600 {where}"


def test_unset_timeouts_are_canns_defaults_and_never_far_above():
    found = verdicts(fixed(load_s=20))  # minimum 100
    assert found["hccl-connect-timeout"][0] == OK and "CANN's default, 120 s" in found["hccl-connect-timeout"][1]
    assert found["hccl-exec-timeout"][0] == OK  # 1836 s is over 10x 100 s, but the user chose nothing
    assert verdicts(fixed())["hccl-connect-timeout"][0] == FAIL  # 120 s < 260 s


def test_an_exec_timeout_of_zero_never_times_out_and_aiv_mode_caps_it():
    assert verdicts(fixed(), HCCL_EXEC_TIMEOUT="0")["hccl-exec-timeout"][0] == WARN
    slow = fixed(load_s=600)  # minimum 1260
    aiv = verdicts(slow, HCCL_EXEC_TIMEOUT="7200", HCCL_OP_EXPANSION_MODE="AIV")["hccl-exec-timeout"]
    assert aiv[0] == FAIL and "caps at 1091 s" in aiv[1]
    assert verdicts(slow, HCCL_EXEC_TIMEOUT="7200")["hccl-exec-timeout"][0] == OK


def test_a_minimum_above_7200_s_fails_the_connect_timeout_whatever_its_value():
    found = verdicts(fixed(load_s=4000), HCCL_CONNECT_TIMEOUT="7200", HCCL_EXEC_TIMEOUT="9000")  # minimum 8060
    status, detail = found["hccl-connect-timeout"]
    assert status == FAIL and "more than HCCL_CONNECT_TIMEOUT can be (7200 s)" in detail
    assert found["hccl-exec-timeout"][0] == OK


@pytest.mark.parametrize("bad", ["7200.5", "-1", "abc", "\u0661\u0662\u0660", "", "1e3", "100"])
def test_bad_timeout_values_fail_naming_the_variable_with_or_without_an_estimate(bad):
    for estimate in (fixed(), None):
        checks = timeout_checks(estimate, {"HCCL_CONNECT_TIMEOUT": bad, "HCCL_EXEC_TIMEOUT": "-3"})
        failed = {c.check: c.detail for c in checks if c.status == FAIL}
        assert set(failed) == {"startup.hccl-connect-timeout", "startup.hccl-exec-timeout"}  # both, in one run
        connect = failed["startup.hccl-connect-timeout"]
        shown = bad if bad in ("-1", "100") else repr(bad)  # an integer out of range is shown as the integer read
        assert connect.startswith(f"HCCL_CONNECT_TIMEOUT={shown}: expected an integer from 120 to 7200"), connect
        assert failed["startup.hccl-exec-timeout"].startswith("HCCL_EXEC_TIMEOUT=-3: expected an integer from 0 to")
        assert not [c for c in checks if c.status == OK]  # never OK on a value that was not range-checked


# --- end to end ------------------------------------------------------------------------------------------------
def test_cli_on_the_example_quotes_the_estimate_and_the_rates(capsys):
    from verl_npu.cli import main

    code = main(["preflight", str(LAUNCH), "--host-memory-gib", "1500", "--checkpoint-read-gbps", "0.1", "--json", "-"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["verdict"] == "go"
    startup = report["startup"]
    assert (startup["shard_bytes_per_node"], startup["read_gbps"]) == (52_461_735_424, 0.1)
    assert (startup["reads"], startup["pre_read_nodes"]) == ("the union of its ranks' shards", 0)
    assert not {"rule", "rule_reason", "node_bytes", "minimum_timeout_s_without_warm_up"} & set(startup)
    assert startup["minimum_timeout_s"] == 1781  # ceil(2 x 52.46 GB / (0.1 x 0.61 GB/s) + 60)
    found = {c["check"]: c for c in report["checks"] if c["check"].startswith("startup.")}
    assert found["startup.hccl-connect-timeout"]["status"] == OK
    assert found["startup.hccl-exec-timeout"]["detail"].startswith("HCCL_EXEC_TIMEOUT=7200 s covers the 1781 s")

    assert main(["preflight", str(LAUNCH), "--checkpoint-read-gbps", "0.1"]) == 0  # the node's RAM changes nothing
    table = " ".join(capsys.readouterr().out.split())
    assert "Start-up: the HF checkpoint load" in table and "0.1 GB/s" in table and "0.61" in table
    assert "the union of its ranks' shards" in table and "(stages [1]): 52.5 GB" in table
    assert "1781 s = 2 x load + 60 s build allowance" in table


def test_cli_refuses_a_bad_rate_before_any_work(capsys):
    from verl_npu.cli import main

    assert main(["preflight", str(LAUNCH), "--checkpoint-read-gbps", "-2"]) == 2
    assert "--checkpoint-read-gbps='-2'" in capsys.readouterr().err


def test_the_example_with_timeouts_below_the_minimum_is_no_go(tmp_path):
    copy = tmp_path / "glm5_2"
    shutil.copytree(EXAMPLE, copy)
    env = copy / "glm5_2.env"
    env.write_text(env.read_text().replace("HCCL_CONNECT_TIMEOUT=7200", "HCCL_CONNECT_TIMEOUT=600"))
    report = run_preflight(copy / LAUNCH.name, host_memory_gib=1500, checkpoint_read_gbps=0.1)
    failed = [c for c in report.checks if c.status == FAIL]
    assert report.verdict == "no-go" and [c.check for c in failed] == ["startup.hccl-connect-timeout"]
    assert "HCCL_CONNECT_TIMEOUT=600 s is below the 1781 s" in failed[0].detail
