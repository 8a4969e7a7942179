"""bench/rl_step.py end to end on the CPU (issue 31): the tiny dense model through our engine and verl 0.9.1's own,
verl's driver stack stood in for as on the nvidia-h200 machine. Every phase of the RL iteration is timed for both
engines with its bytes; both export the same tensors, bit for bit, equal to the checkpoint's; both give the loaded
model the same log-probs; the machine's limits are there; a failing engine is named with its phase. And the FP8
checkpoint writer (bench/rl_step_models.py) reads back through our loader as its bf16 weights within FP8's rounding.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.paths import REPO

pytest.importorskip("verl", reason="verl is not installed here")
pytest.importorskip("mbridge", reason="verl's Megatron engine builds through mbridge; not installed here")

BENCH = REPO / "bench" / "rl_step.py"


def _bench_module(name: str):
    """A bench/ script as a module (bench/ is no package: its scripts import each other from their folder)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rl_step_models = _bench_module("rl_step_models")

BUCKET_MB = 0.1  # below the tiny model's embedding (131 kB): both a cut bucket and a tensor sent on its own
BYTE_PHASES = (
    "load", "export", "export_again", "offload", "onload", "offload_again", "onload_again", "save", "checkpoint_load",
    "save_again",
)  # fmt: skip
TOKEN_PHASES = ("old_log_prob", "ref_log_prob", "train")


def run_bench(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(BENCH), "--model", "dense", "--tiny", "--without-driver", "--out",
            str(tmp / "out.json"), "--work", str(tmp / "work"), "--bucket-mb", str(BUCKET_MB), *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900, check=False)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl_step")
    done = run_bench(tmp, "--profile", "save")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads((tmp / "out.json").read_text()), tmp / "work", done.stdout


def test_every_phase_is_timed_for_both_engines_with_its_bytes(bench):
    result, _, stdout = bench
    for engine in ("ours", "verl"):
        phases = result["engines"][engine]["phases"]
        assert set(phases) == set(BYTE_PHASES + TOKEN_PHASES), engine
        for name, record in phases.items():
            assert record["seconds"] > 0, (engine, name)
        for name in BYTE_PHASES:
            assert phases[name]["bytes"] > 0 and phases[name]["gb_per_s"] > 0, (engine, name)
            assert phases[name]["fraction_of_limit"] > 0, (engine, name)
        for name in TOKEN_PHASES:
            assert phases[name]["tokens"] == 4 * 2 * 32, (engine, name)  # 4 micro-batches of 2 sequences of 32
        checkpoint_bytes = result["model"]["checkpoint_bytes"]
        assert phases["load"]["bytes"] == checkpoint_bytes
        state = result["engines"][engine]["state_bytes"]
        moved = {phases[p]["bytes"] for p in ("offload", "onload", "offload_again", "onload_again")}
        assert moved == {state["params"] + state["optimizer"]} and state["grads"] > 0  # gradients are not copied
        assert phases["save"]["bytes"] == phases["checkpoint_load"]["bytes"] == phases["save_again"]["bytes"]
    assert "checkpoint_load" in stdout and "ours/verl speed" in stdout  # the table
    assert result["order"] == ["ours", "verl"]  # --verl-first reverses it
    assert set(result["compare"]["speed_ours_over_verl"]) == set(BYTE_PHASES + TOKEN_PHASES)


def test_export_is_packed_and_handed_off_as_verls_bucketed_sender_cuts_it(bench):
    result, _, _ = bench
    for engine in ("ours", "verl"):
        export = result["engines"][engine]["phases"]["export"]
        bucket = export["bucket_bytes"]
        assert bucket == int(BUCKET_MB * (1 << 20))
        buckets = export["buckets"]
        assert sum(b["bytes"] for b in buckets) == export["bytes"]
        assert sum(b["tensors"] for b in buckets) == export["tensors"]
        assert [b["seconds"] for b in buckets] == sorted(b["seconds"] for b in buckets)
        assert all(b["bytes"] <= bucket for b in buckets if not b["direct"])
        direct = [b for b in buckets if b["direct"]]
        assert direct and all(b["bytes"] > bucket and b["tensors"] == 1 for b in direct)  # the embedding
        assert len(buckets) - len(direct) >= 2


def test_both_engines_export_the_checkpoints_tensors_bit_for_bit(bench):
    result, _, _ = bench
    ours, theirs = (result["engines"][e]["export_digest_loaded"] for e in ("ours", "verl"))
    index = json.loads((Path(result["model"]["checkpoint"]) / rl_step_models.INDEX_FILE).read_text())
    assert set(ours) == set(index["weight_map"])  # tied embeddings: no separate lm_head in either
    assert ours == theirs  # names, shapes, dtypes, bytes, SHA-256
    assert all(entry["dtype"] == "bfloat16" and entry["bytes"] > 0 for entry in ours.values())
    assert result["compare"]["exports_identical"] and result["compare"]["exports_equal_checkpoint"] == {
        "ours": True, "verl": True}  # fmt: skip
    # the digests see a change: after the training step every engine exports other bytes than it loaded
    trained = result["engines"]["ours"]["export_digest_trained"]
    assert {name for name in ours if ours[name]["sha256"] != trained[name]["sha256"]}


def test_the_loaded_models_log_probs_are_the_same_in_both_engines(bench):
    _, work, _ = bench
    ours, theirs = (torch.load(work / f"{engine}_log_probs.pt") for engine in ("ours", "verl"))
    assert ours.shape == theirs.shape == (8, 16)
    assert torch.isfinite(ours).all() and (ours < 0).all() and ours.std() > 0.1
    # both are bf16 computations of one model; one bf16 rounding of a log-prob is 2**-8 of it
    assert ((ours - theirs).abs() <= ours.abs().clamp_min(1) * 2**-8).all(), (ours - theirs).abs().max()


def test_offload_onload_save_and_load_keep_the_trained_model(bench):
    result, _, _ = bench
    for engine in ("ours", "verl"):
        assert result["engines"][engine]["round_trip"] == {"log_probs_equal": True, "changed_by_training": True}


def test_the_engines_are_ours_and_verls_own_with_the_driver_stack_stood_in(bench):
    import verl

    result, _, _ = bench
    ours, theirs = result["engines"]["ours"], result["engines"]["verl"]
    assert ours["engine_class"] == "verl_npu.engine.verl_engine.NPUMegatronEngineWithLMHead"
    assert theirs["engine_class"] == "verl.workers.engine.megatron.transformer_impl.MegatronEngineWithLMHead"
    for record in (ours, theirs):
        assert record["verl"]["engine_file"].startswith(verl.__path__[0])
        assert record["verl"]["stood_in"] == ["ray", "datasets", "pandas", "wandb", "tensorboard"]
        assert "ray.ObjectRef" in record["verl"]["touched"]
    assert "verl_npu_layer" not in theirs  # verl's process on the dense model runs without our runtime layer


def test_the_machines_limits_are_measured_in_the_same_run(bench):
    result, _, _ = bench
    limits = result["limits"]
    assert set(limits) == {"disk_read", "disk_write", "host_to_device", "device_to_host", "device_copy"}
    assert limits["disk_read"]["bytes"] == limits["disk_write"]["bytes"] == result["model"]["checkpoint_bytes"]
    assert limits["disk_write"]["synced"] and not list((Path(result["model"]["checkpoint"]).parent).glob("*.bin"))
    assert all(v["bytes"] > 0 and v["seconds"] > 0 and v["gb_per_s"] > 0 for v in limits.values())
    assert result["device"]["kind"] == "cpu" and result["versions"]["verl"] == "0.9.1"


def truncated_checkpoint(bench, where: Path) -> Path:
    """The bench's HF checkpoint with every safetensors file cut in half."""
    result, _, _ = bench
    where.mkdir()
    for path in Path(result["model"]["checkpoint"]).iterdir():
        data = path.read_bytes()
        (where / path.name).write_bytes(data[: len(data) // 2] if path.suffix == ".safetensors" else data)
    return where


def test_a_failing_engine_stops_the_run_naming_it_and_its_phase(bench, tmp_path):
    done = run_bench(tmp_path, "--checkpoint", str(truncated_checkpoint(bench, tmp_path / "broken")))
    assert done.returncode != 0
    assert "PhaseFailed: ours engine failed in phase load" in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_a_failing_rank_is_named_with_its_phase_among_every_failed_rank(bench, tmp_path):
    broken = truncated_checkpoint(bench, tmp_path / "broken")
    done = run_bench(tmp_path, "--checkpoint", str(broken), "--tp", "2", "--save-contents", "none")
    assert done.returncode != 0
    assert "PhaseFailed: ours engine failed on 2 of 2 ranks" in done.stderr, done.stderr[-3000:]
    assert "rank 0: phase load: " in done.stderr and "rank 1: phase load: " in done.stderr


def test_bad_arguments_are_refused_with_the_fix():
    done = subprocess.run([sys.executable, str(BENCH), "--model", "dense", "--fp8", "--out", "x.json"],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 2 and "use --model glm5" in done.stderr
    done = subprocess.run([sys.executable, str(BENCH), "--model", "dense", "--profile", "save,lod", "--out", "x.json"],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 2 and "['lod'] are not phases" in done.stderr and "checkpoint_load" in done.stderr
    done = subprocess.run([sys.executable, str(BENCH), "--model", "dense", "--ep", "2", "--out", "x.json"],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 2 and "--ep 2 with --model dense" in done.stderr and "use --model glm5" in done.stderr
    done = subprocess.run([sys.executable, str(BENCH), "--model", "dense", "--tp", "0", "--out", "x.json"],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 2 and "--tp 0: give a positive number" in done.stderr


@pytest.mark.slow
def test_per_rank_every_rank_runs_every_phase_and_one_rank_writes_the_shared_files(bench, tmp_path):
    """--tp 2 (issue 33, item 2): two gloo ranks per engine, each timing every phase; the exports and log-probs
    still match between the engines and the checkpoint."""
    done = run_bench(tmp_path, "--tp", "2", "--no-transitions")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads((tmp_path / "out.json").read_text())
    work = tmp_path / "work"
    assert result["sizes"]["tp"] == 2 and result["sizes"]["ep"] == 1
    for engine in ("ours", "verl"):
        ranks = result["engines"][engine]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        for phase in ("load", "old_log_prob", "train", "export", "save", "checkpoint_load", "save_again"):
            assert all(r["phases"][phase]["seconds"] > 0 for r in ranks), (engine, phase)
        for phase in ("load", "export"):  # each rank loads the whole HF checkpoint and exports every full tensor
            assert ranks[0]["phases"][phase]["bytes"] == ranks[1]["phases"][phase]["bytes"] > 0
        assert sorted(p.name for p in work.glob(f"{engine}*.json")) == [f"{engine}.rank0.json", f"{engine}.rank1.json"]
        assert [p.name for p in work.glob(f"{engine}_log_probs*")] == [f"{engine}_log_probs.pt"]
        assert not (work / f"{engine}_checkpoint").exists()  # removed once measured, by one rank
    compared = result["compare"]
    assert compared["exports_identical"] and compared["trained_exports_identical"]
    assert compared["exports_equal_checkpoint"] == {"ours": True, "verl": True}
    assert compared["log_probs_max_abs_difference"] == 0
    assert "per rank, TP 2 x EP 1" in done.stdout


def test_a_profiled_phase_names_where_its_time_went(bench):
    result, _, _ = bench
    assert result["profiled"] == ["save"]
    for engine in ("ours", "verl"):
        phases = result["engines"][engine]["phases"]
        profile = phases["save"]["profile"]
        functions = [row["function"] for row in profile["by_cumulative"]]
        # megatron's checkpoint writer is in it, and no row is worth more than the phase
        assert any("dist_checkpointing/strategies/filesystem_async.py" in f for f in functions), functions
        assert all(0 <= row["cumulative_s"] <= phases["save"]["seconds"] * 1.01 for row in profile["by_cumulative"])
        assert 10 <= len(profile["by_own"]) <= 40  # PROFILE_ROWS
        assert "profile" not in phases["load"]  # only what was asked


# --- the checkpoint writer -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_step_models")
    return {
        model: rl_step_models.write(model, root / model, tiny=True, fp8=True, shard_bytes=200_000)
        for model in ("dense", "glm5")
    }


@pytest.mark.parametrize("model", ["dense", "glm5"])
def test_the_fp8_checkpoint_reads_back_through_our_loader_as_its_bf16_weights(fp8_checkpoints, model):
    from safetensors import safe_open

    from verl_npu.engine.bridges.fp8_safetensors import BlockFP8SafeTensorIO

    path = fp8_checkpoints[model]
    table = rl_step_models.tensor_table(model, tiny=True)
    loaded = BlockFP8SafeTensorIO(str(path)).load_some_hf_weight(list(table))
    assert set(loaded) == set(table)
    quantised = [name for name, (shape, _) in table.items() if rl_step_models.quantised(name, shape)]
    assert len(quantised) > len(table) // 3
    scales = {}
    for shard in rl_step_models.safetensors_files(path):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                if name.endswith("_scale_inv"):
                    scales[name.removesuffix("_scale_inv")] = f.get_tensor(name)
                else:
                    assert (f.get_tensor(name).dtype == torch.float8_e4m3fn) == (name in quantised), name
    assert set(scales) == set(quantised)
    inexact = 0
    for name, (shape, kind) in table.items():
        bf16 = rl_step_models.bf16_weight(name, shape, kind)
        if name not in quantised:
            assert torch.equal(loaded[name], bf16), name
            continue
        scale = scales[name]
        assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) and scale.dtype == torch.float32
        per_element = scale.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
        # e4m3 keeps 3 mantissa bits (half a step: 2**-4 relative), its subnormal step is 2**-9 of the block scale,
        # and the dequantised value is rounded to bf16 once more (2**-8 relative)
        exact = bf16.float()
        bound = exact.abs() * (2**-4 + 2**-8) + per_element * 2**-10 + 1e-30
        error = (loaded[name].float() - exact).abs()
        assert loaded[name].dtype == torch.bfloat16 and (error <= bound).all(), (name, (error / bound).max())
        inexact += int((error > 0).any())
    assert inexact > 0  # FP8 did round: the bound is what is being tested


def test_the_checkpoint_is_sharded_with_an_index_of_every_tensor(fp8_checkpoints):
    path = fp8_checkpoints["dense"]
    shards = rl_step_models.safetensors_files(path)
    index = json.loads((path / rl_step_models.INDEX_FILE).read_text())
    assert len(shards) > 1 and set(index["weight_map"].values()) == {s.name for s in shards}
    assert all(s.name.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert (path / "tokenizer.json").is_file()
