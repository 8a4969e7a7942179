"""Benchmark: the engine-side phases of one RL iteration, verl-npu's engine against verl 0.9.1's, same model, same
run, each against the machine's limits measured in that run (issue 31, items 1, 2 and 4).

What runs. Each engine runs in its own process (our runtime patches are process-wide), built through verl's
``EngineRegistry`` from an HF checkpoint written by bench/rl_step_models.py. verl's engine is verl's own class,
``MegatronEngineWithLMHead``, from its installed file; nothing of verl is re-implemented here, and every timed call
is a method verl's trainer calls on an engine:

- ``load``: ``engine.initialize()``, build plus HF checkpoint load (the checkpoint's files evicted from the page
  cache first, so that both engines read them cold);
- ``old_log_prob``, ``ref_log_prob``: ``engine.infer_batch`` inside ``engine.eval_mode()`` (forward only; the
  reference pass runs on the same engine, as the same computation a reference engine does);
- ``train``: ``engine.train_batch`` with verl's ``ppo_loss`` inside ``engine.train_mode()``, ``--micro-batches``
  micro-batches;
- ``export``: the whole ``engine.get_per_tensor_param()`` stream, each tensor copied into one preallocated device
  buffer of ``--bucket-mb`` as verl's ``BucketedWeightSender`` packs its bucket (verl/workers/rollout/vllm_rollout/
  bucketed_weight_transfer.py: offsets aligned to the element size; a bucket is handed off, after a device
  synchronise, when the next tensor does not fit; a tensor larger than the bucket goes on its own); the time at
  each hand-off is recorded. The IPC to vLLM is not run (the device has no vLLM). ``export_again`` is the same on
  the next step (verl caches its conversion tasks after the first);
- ``save``, ``checkpoint_load``, ``save_again``: ``engine.save_checkpoint`` / ``engine.load_checkpoint`` (its
  files evicted from the page cache before the load), then the next step's save (the first pays what a process pays
  once: megatron's write-results manager process, torch's first pinned blocks);
- ``offload``, ``onload``: ``engine.to("cpu")`` / ``engine.to(<device>)`` of parameters, gradients and optimizer,
  the first time (an engine may allocate its host buffers then); ``offload_again``, ``onload_again``: the next
  step's, as every later step pays them.

The device is synchronised around every phase. Bytes: the checkpoint's files (load), the exported tensors (export),
the DDP parameter buffers plus the optimizer's fp32 main parameters and moments (offload, onload: both engines free
the gradient buffers and allocate them zeroed again, copying nothing), the saved files (save, checkpoint_load).
Limits, in the parent process: reading the checkpoint's files as ``cat`` does (1 MiB reads, evicted with
``posix_fadvise(DONTNEED)`` first); writing as many bytes (at most 4 GiB) in 1 MiB writes and ``fsync`` (the save's
limit); pinned host-to-device and device-to-host copies; a device-to-device copy. On the CPU (no device) the copy
limits are host memory copies, not pinned.

Where verl's stack is not whole. The nvidia-h200 machine has no Ray, datasets, pandas, wandb or tensorboard (only
small wheels reach it, bench/rl_step_carry.py). Where any is absent, verl's engine module is imported through
verl_npu/testing/verl_without_driver.py: the package ``__init__`` files of ``verl``, ``verl.workers`` and
``verl.workers.engine`` are skipped and the absent packages are stand-ins; calling into one raises. The JSON lists
the stand-ins and every stand-in attribute the imports touched (``touched()``). Where the stack is present, verl is
imported whole (``--without-driver`` forces the stand-ins, as the device has them).

What verl's engine gets beyond verl. TransformerEngine is absent on both machines, and mbridge 0.15.1 builds only
on TransformerEngine's layer spec; so verl's engine instance builds on megatron-core's local spec with its HF names
mapped (verl_npu/engine/mbridge_local.py::build_on_local_spec) and takes verl's right-padding mask through
``install_mask_adapter``, the two build steps our engine takes off Ascend (verl_npu/engine/build.py). mbridge 0.15.1
cannot build GLM-5 at all: for ``--model glm5`` verl's process loads verl-npu's runtime layer too (its GLM-5 bridge,
which both engines then load and export through, and megatron DSA patches), but not our engine (the registry
gives verl's class). Our process sets ``VERL_ENGINE_DEVICE=npu VERL_ENGINE_VENDOR=huawei`` and loads the layer
(``VERL_NPU_ALLOW_MISMATCH=1``: the device's torch is not the pinned one; the mismatches are in the JSON).

``--fp8`` is GLM-5 only (mbridge's Qwen2 bridge has no FP8 reader); the model it saves is the dequantised bf16 one
(verl_npu/engine/bridges/hf_save.py). ``--no-transitions`` leaves out the four offload/onload phases.
``--verl-first`` runs verl's engine first (the JSON's ``order``). ``--profile save,load`` runs those phases under
cProfile and keeps each one's top functions in the JSON (the profiler slows Python-bound phases: time them
without it).
``--save-contents none`` leaves out both checkpoint phases (what a 64 GiB disk
allows for GLM-5 with its optimizer).

Correctness, in the same run: the exported tensors' names, shapes, dtypes and SHA-256 of their bytes, and the
loaded model's old-log-probs, from both engines (the JSON's ``compare``). Either engine failing stops the run,
naming the engine and the phase.

Per rank (issue 33, item 2): ``--tp N`` and ``--ep N`` run each engine as torchrun's TP x EP ranks, one device
each (EP takes its ranks from data parallelism), every phase started by all ranks at once after a barrier, as a
training job's ranks load and export together. Each rank records its own phases (the JSON's ``engines.<e>.ranks``;
the top-level phases are rank 0's); one rank writes the log-probs and removes a saved checkpoint. On the CPU the
ranks run on gloo: a check of the script, not a figure.

    python bench/rl_step.py --model dense|glm5 [--fp8] [--tiny] [--tp N] [--ep N] \\
        --out bench/results/rl_step_<model>_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime as dt
import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import rl_step_models  # beside this script: its folder is the script's first import path
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[1]

ENGINES = ("ours", "verl")
PHASES = (
    "load", "old_log_prob", "ref_log_prob", "train", "export", "export_again", "offload", "onload", "offload_again",
    "onload_again", "save", "checkpoint_load", "save_again",
)  # fmt: skip
# the limit each phase's rate is a fraction of (None: a compute phase, no bytes limit)
LIMIT_OF = {
    "load": "disk_read", "export": "device_copy", "export_again": "device_copy", "save": "disk_write",
    "save_again": "disk_write",
    "checkpoint_load": "disk_read", "offload": "device_to_host", "onload": "host_to_device",
    "offload_again": "device_to_host", "onload_again": "host_to_device",
}  # fmt: skip
WRITE_BYTES = 4 << 30  # at most: the disk write limit writes as much as the checkpoint holds, up to this
READ_CHUNK = 1 << 20
COPY_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}  # the copies that measure the limits
LEARNING_RATE = 1e-3  # large enough that one step changes bf16 weights: the round-trip check then sees a new model
GB = 1e9


class PhaseFailed(RuntimeError):
    """An engine failed in one phase of the iteration."""


# --- machine limits ---------------------------------------------------------------------------------------------------
def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (dirty pages are written first, or they would stay)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def read_like_cat(paths: list[Path]) -> tuple[int, float]:
    """(bytes, seconds) of reading every file sequentially into one reused buffer, after evicting them."""
    evict(paths)
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    total = 0
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                total += n
    return total, time.perf_counter() - started


def write_and_sync(path: Path, nbytes: int) -> tuple[int, float]:
    """(bytes, seconds) of writing ``nbytes`` in 1 MiB writes and fsync-ing them: the disk's durable write rate."""
    chunk = memoryview(os.urandom(READ_CHUNK))
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for offset in range(0, nbytes, READ_CHUNK):
            f.write(chunk[: min(READ_CHUNK, nbytes - offset)])
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return nbytes, seconds


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _best_copy_seconds(destination: Any, source: Any, device: str, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        destination.copy_(source, non_blocking=True)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def measure_limits(files: list[Path], device: str, copy_bytes: int, work: Path, repeats: int = 3) -> dict[str, Any]:
    import torch

    read_bytes, read_seconds = read_like_cat(files)
    limits: dict[str, Any] = {"disk_read": {"bytes": read_bytes, "seconds": read_seconds}}
    written, write_seconds = write_and_sync(work / "disk_write_limit.bin", min(read_bytes, WRITE_BYTES))
    limits["disk_write"] = {"bytes": written, "seconds": write_seconds, "synced": True}
    pinned = device == "cuda"
    host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(1)
    on_device = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    other = torch.empty_like(on_device)
    on_device.fill_(2)
    for name, (destination, source) in {
        "host_to_device": (on_device, host), "device_to_host": (host, on_device), "device_copy": (other, on_device),
    }.items():  # fmt: skip
        seconds = _best_copy_seconds(destination, source, device, repeats)
        limits[name] = {"bytes": copy_bytes, "seconds": seconds, "pinned": pinned}
    for value in limits.values():
        value["gb_per_s"] = value["bytes"] / value["seconds"] / GB
    del host, on_device, other
    if device == "cuda":
        torch.cuda.empty_cache()  # the engines' processes get the device without this process's cached blocks
    return limits


# --- the child: one engine ------------------------------------------------------------------------------------------
class Recorder:
    """Phase timings of one engine; the phase running when it fails is kept for the parent."""

    def __init__(self, device: str, out: Path, profiled: tuple[str, ...] = (), together: bool = False):
        """``together``: every rank starts each phase at once (a barrier first), as a training job's ranks do."""
        self.device, self.out, self.profiled, self.together = device, out, profiled, together
        self.result: dict[str, Any] = {"phases": {}, "failed_phase": None}

    @contextlib.contextmanager
    def phase(self, name: str, **facts: Any) -> Iterator[dict[str, Any]]:
        record: dict[str, Any] = dict(facts)
        self.result["failed_phase"] = name
        self.write()
        profiler = cProfile.Profile() if name in self.profiled else None
        synchronize(self.device)
        if self.together:
            import torch.distributed as dist

            dist.barrier()
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        yield record
        synchronize(self.device)
        record["seconds"] = time.perf_counter() - started
        if profiler:
            profiler.disable()
            record["profile"] = profile_summary(profiler)
        if record.get("bytes"):
            record["gb_per_s"] = record["bytes"] / record["seconds"] / GB
        self.result["phases"][name] = record
        self.result["failed_phase"] = None
        self.write()

    def write(self) -> None:
        self.out.write_text(json.dumps(self.result, indent=2, sort_keys=True, default=str) + "\n")


PROFILE_ROWS = 40


def profile_summary(profiler: cProfile.Profile, rows: int = PROFILE_ROWS) -> dict[str, list[dict[str, Any]]]:
    """The phase's main-thread functions by cumulative and by own time (cProfile: threads and child processes are
    seen only where the main thread waits for them)."""
    stats = pstats.Stats(profiler).stats  # (file, line, function) -> (primitive calls, calls, own s, cumulative s, _)

    def where(key: tuple[str, int, str]) -> str:
        file, line, function = key
        for marker in ("site-packages/", "/verl_npu/", "/bench/"):
            if marker in file:
                file = file.split(marker, 1)[1]
                break
        return f"{file}:{line}({function})"

    def top(column: int) -> list[dict[str, Any]]:
        ranked = sorted(stats.items(), key=lambda item: item[1][column], reverse=True)[:rows]
        return [{"function": where(key), "calls": calls, "own_s": round(own, 4), "cumulative_s": round(cum, 4)}
                for key, (_, calls, own, cum, _) in ranked]  # fmt: skip

    return {"by_cumulative": top(3), "by_own": top(2)}


class _UnpinnedOnTheCpu(TorchFunctionMode):
    """The CPU check run only (no accelerator): pinned host memory needs a CUDA driver, so a request for it (verl's
    offload allocates its host copies pinned) gets ordinary host memory; nothing else changes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import torch

        kwargs = dict(kwargs or {})
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.pin_memory:
            return args[0]
        return func(*args, **kwargs)


def _import_verl(without_driver: bool) -> dict[str, Any]:
    """verl's engine module, whole where verl's driver stack is here, else without it (module docstring)."""
    from verl_npu.testing import verl_without_driver as loader

    absent = [name for name in loader.DRIVER_STACK if importlib.util.find_spec(name) is None]
    if without_driver or absent:
        impl = loader.import_engine(absent=loader.DRIVER_STACK if without_driver else tuple(absent))
        how = "without its driver stack (verl_npu/testing/verl_without_driver.py)"
    else:
        import verl  # noqa: F401  (verl's own __init__, with its driver stack)

        impl = loader.import_engine()
        how = "whole (its driver stack is installed)"
    return {
        "imported": how, "engine_file": impl.__file__, "stood_in": list(loader.stood_in()),
        "touched": loader.touched(),
    }  # fmt: skip


def _adapt_to_local_spec(engine: Any) -> list[str]:
    """verl's engine instance builds on megatron-core's local spec where TransformerEngine is absent (docstring)."""
    from verl_npu.engine.layer_spec import transformer_engine_available
    from verl_npu.engine.mbridge_local import build_on_local_spec, install_mask_adapter

    if transformer_engine_available():
        return []
    build_tf_config, build_module = engine._build_tf_config, engine._build_megatron_module

    def tf_config_on_local_spec() -> None:
        build_tf_config()
        build_on_local_spec(engine.bridge, fused_rmsnorm=False)

    def module_with_mask_adapter() -> Any:
        module = build_module()
        install_mask_adapter(module)
        return module

    engine._build_tf_config, engine._build_megatron_module = tf_config_on_local_spec, module_with_mask_adapter
    return ["megatron-core local layer spec (mbridge_local.build_on_local_spec)", "right-padding mask adapter"]


def _engine_settings(model: str, tiny: bool, device: str, tp: int = 1) -> dict[str, Any]:
    """override_transformer_config: no dropout (deterministic log-probs), CPU initialisation on the CPU; GLM-5 as
    the parity job runs it (tokens to the experts by allgather, full recompute). At TP > 1, no sequence parallelism
    for either engine (mbridge turns it on with TP): verl's engine builds on megatron's local spec here (no
    TransformerEngine), whose torch norm refuses it; load and export move weights, which it does not split."""
    otc: dict[str, Any] = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "use_cpu_initialization": device == "cpu"}
    if tp > 1:
        otc["sequence_parallel"] = False
    if model == "glm5":
        otc |= {
            "moe_token_dispatcher_type": "allgather", "variable_seq_lengths": False, "recompute_granularity": "full",
            "recompute_method": "uniform", "recompute_num_layers": 1,
        }  # fmt: skip
    return otc


def _batch(spec: dict[str, Any], seed: int, count: int, old_log_probs: Any = None) -> Any:
    """``count`` sequences of ``spec['seq']`` tokens as verl's trainer hands them to the engine (no padding); for
    training, with the old-log-prob pass's log-probs (PPO's ratio starts at 1) and random advantages."""
    import torch
    from verl.protocol import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    seq, prompt = spec["seq"], spec["seq"] // 2
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, spec["vocab_size"], (count, seq), generator=generator)
    mask = torch.ones_like(input_ids)
    responses = input_ids[:, prompt:]
    fields = {
        "input_ids": input_ids, "prompts": input_ids[:, :prompt], "attention_mask": mask,
        "position_ids": torch.arange(seq).expand(count, seq).clone(), "responses": responses,
        "response_mask": mask[:, prompt:],
        "old_log_probs": torch.zeros_like(responses, dtype=torch.float32) if old_log_probs is None else old_log_probs,
        "advantages": torch.randn(responses.shape, generator=generator, dtype=torch.float32),
    }  # fmt: skip
    td = left_right_2_no_padding(DataProto.from_single_dict(fields, meta_info={"temperature": 1.0}).to_tensordict())
    mbs = spec["micro_batch_size"]
    tu.assign_non_tensor(td, global_batch_size=count, use_dynamic_bsz=False, micro_batch_size_per_gpu=mbs)
    tu.assign_non_tensor(td, calculate_entropy=False)
    return td


def state_bytes(engine: Any) -> dict[str, int]:
    """Bytes of what offload moves: DDP parameter and gradient buffers, the optimizer's fp32 main parameters and
    its state (Adam's moments)."""
    import torch

    params = grads = 0
    for chunk in engine.module:
        for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            params += buffer.param_data.nbytes if buffer.param_data is not None else 0
            grads += buffer.grad_data.nbytes if buffer.grad_data is not None else 0
    optimizer = 0
    for inner in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for group in getattr(inner, "shard_fp32_from_float16_groups", []):
            optimizer += sum(p.nbytes for p in group)
        for state in inner.optimizer.state.values():
            optimizer += sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


def _export(engine: Any, device: str, bucket_bytes: int, buffer: Any) -> dict[str, Any]:
    """verl's export stream packed into ``buffer`` as BucketedWeightSender packs it; the hand-off times."""

    started = time.perf_counter()
    per_tensor, _ = engine.get_per_tensor_param()
    offset = total = tensors = 0
    in_bucket: list[int] = []  # bytes of the tensors in the open bucket
    handoffs: list[dict[str, Any]] = []

    def hand_off(nbytes: int, tensors_in_it: int, direct: bool) -> None:
        synchronize(device)
        handoffs.append({"seconds": time.perf_counter() - started, "bytes": nbytes, "tensors": tensors_in_it,
                         "direct": direct})  # fmt: skip

    for _name, weight in per_tensor:
        tensors += 1
        total += weight.nbytes
        offset = -(-offset // weight.element_size()) * weight.element_size()
        if offset + weight.nbytes > bucket_bytes and in_bucket:
            hand_off(sum(in_bucket), len(in_bucket), direct=False)
            in_bucket, offset = [], 0
        if weight.nbytes > bucket_bytes:  # verl sends it by its own IPC handle, without the buffer
            hand_off(weight.nbytes, 1, direct=True)
            continue
        destination = buffer[offset : offset + weight.nbytes].view(weight.dtype).view(weight.shape)
        destination.copy_(weight, non_blocking=True)
        offset += weight.nbytes
        in_bucket.append(weight.nbytes)
    hand_off(sum(in_bucket), len(in_bucket), direct=False)
    return {"bytes": total, "tensors": tensors, "buckets": handoffs}


def export_digest(engine: Any) -> dict[str, dict[str, Any]]:
    """name -> shape, dtype, bytes and SHA-256 of every exported tensor (an untimed pass)."""
    import torch

    out = {}
    per_tensor, _ = engine.get_per_tensor_param()
    for name, weight in per_tensor:
        # a copy: numpy() would pin the storage it shares (an exported view of a parameter) as not resizable
        host = weight.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8)
        out[name] = {
            "shape": list(weight.shape), "dtype": str(weight.dtype).removeprefix("torch."), "bytes": weight.nbytes,
            "sha256": hashlib.sha256(host.numpy()).hexdigest(),
        }  # fmt: skip
    return out


def _log_probs(engine: Any, td: Any) -> Any:
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    with engine.eval_mode():
        out = engine.infer_batch(td)
    return no_padding_2_padding(tu.get(out["model_output"], "log_probs"), td).float().cpu()


def _setup(engine_kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Device, process group, the verl-npu layer (ours, and verl's on GLM-5), verl's engine module."""
    facts: dict[str, Any] = {}
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("verl_npu").setLevel(logging.INFO)  # the child's log: the load's read and pre-read times
    if engine_kind == "ours":
        os.environ.update(VERL_ENGINE_DEVICE="npu", VERL_ENGINE_VENDOR="huawei")
    else:
        for key in ("VERL_ENGINE_DEVICE", "VERL_ENGINE_VENDOR"):
            os.environ.pop(key, None)
    if engine_kind == "ours" or spec["model"] == "glm5":
        os.environ["VERL_NPU_ALLOW_MISMATCH"] = "1"
        import verl_npu.megatron_adaptor as layer

        loaded = layer.load()
        facts["verl_npu_layer"] = {"platform": loaded.platform, "stack_mismatches": loaded.stack_mismatches}
    # verl before the device set-up: megatron imports wandb if it can, and where verl's driver stack is stood in
    # for, that import must meet the stand-in (as on the device, which has no wandb), not an installed wandb
    facts["verl"] = _import_verl(spec["without_driver"])
    if spec["device"] == "cpu":
        from verl_npu.testing import cpu_megatron

        cpu_megatron.activate()
        if world_size(spec) == 1:
            cpu_megatron.init_model_parallel()
        _UnpinnedOnTheCpu().__enter__()
        facts["cpu_stand_ins"] = ["verl_npu/engine/cpu_device.py", "pinned host memory allocated unpinned"]
    elif world_size(spec) == 1:
        from verl_npu.testing.distributed import init_single_process

        init_single_process("nccl", 0)
    if world_size(spec) > 1:  # torchrun's ranks; verl's engine builds megatron's groups from its config's sizes
        import torch
        import torch.distributed as dist

        if spec["device"] == "cpu":
            dist.init_process_group("gloo")
        else:
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        facts["rank"], facts["world_size"] = dist.get_rank(), dist.get_world_size()
    if engine_kind == "ours":
        import verl_npu.engine.verl_engine  # noqa: F401  (registers our engine, as the layer does on verl's import)
    return facts


def world_size(spec: dict[str, Any]) -> int:
    """Ranks per engine: TP x EP (EP takes its ranks from data parallelism, as megatron's groups do)."""
    return int(spec["tp"]) * int(spec["ep"])


def rank_suffix(spec: dict[str, Any]) -> str:
    """'' for one rank; '.rank<R>' for a rank of several (each rank writes its own files, never a shared one)."""
    return f".rank{os.environ.get('RANK', '0')}" if world_size(spec) > 1 else ""


def _first_rank(spec: dict[str, Any]) -> bool:
    return world_size(spec) == 1 or os.environ.get("RANK", "0") == "0"


def _barrier(spec: dict[str, Any]) -> None:
    if world_size(spec) > 1:
        import torch.distributed as dist

        dist.barrier()


def run_engine(engine_kind: str, spec: dict[str, Any], out: Path) -> None:
    import torch

    recorder = Recorder(spec["device"], out, tuple(spec.get("profile", ())), together=world_size(spec) > 1)
    recorder.result.update(engine=engine_kind, failed_phase="setup")
    recorder.write()
    recorder.result.update(_setup(engine_kind, spec))
    from verl.trainer.config import CheckpointConfig
    from verl.utils.device import get_device_name
    from verl.workers.config import ActorConfig, HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss

    work = Path(spec["work"])
    engine = EngineRegistry.new(
        model_type="language_model",
        backend="megatron",
        model_config=HFModelConfig(path=spec["checkpoint"]),
        engine_config=McoreEngineConfig(
            forward_only=False, vanilla_mbridge=True, use_remove_padding=False, dtype="bfloat16",
            override_transformer_config=_engine_settings(spec["model"], spec["tiny"], spec["device"], spec["tp"]),
            tensor_model_parallel_size=spec["tp"], expert_model_parallel_size=spec["ep"],
            sequence_parallel=False,  # and in the transformer config (_engine_settings)
        ),
        optimizer_config=McoreOptimizerConfig(lr=LEARNING_RATE, lr_decay_steps=10),
        checkpoint_config=CheckpointConfig(save_contents=spec["save_contents"], load_contents=spec["save_contents"]),
    )  # fmt: skip
    recorder.result["engine_class"] = f"{type(engine).__module__}.{type(engine).__qualname__}"
    recorder.result["build_adaptations"] = _adapt_to_local_spec(engine) if engine_kind == "verl" else []
    checkpoint_files = rl_step_models.safetensors_files(spec["checkpoint"])
    evict(checkpoint_files)
    _barrier(spec)  # no rank evicts what another has begun to read
    with recorder.phase("load", bytes=sum(f.stat().st_size for f in checkpoint_files)):
        engine.initialize()
    if spec["device"] == "cpu":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)  # megatron seeds its RNG tracker only when CUDA is up
    micro, count = spec["micro_batch_size"], spec["micro_batches"] * spec["micro_batch_size"]
    infer_td = _batch(spec, seed=1, count=count)
    tokens = count * spec["seq"]
    with recorder.phase("old_log_prob", tokens=tokens):
        old = _log_probs(engine, infer_td)
    if _first_rank(spec):  # every rank computes the same log-probs; one writes them
        torch.save(old, work / f"{engine_kind}_log_probs.pt")
    recorder.result["export_digest_loaded"] = export_digest(engine)  # untimed: the loaded model, as exported
    with recorder.phase("ref_log_prob", tokens=tokens):
        _log_probs(engine, infer_td)
    actor = ActorConfig(strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=micro)
    train_td = _batch(spec, seed=1, count=count, old_log_probs=old)
    with recorder.phase("train", tokens=tokens, micro_batches=spec["micro_batches"]) as record:
        with engine.train_mode():
            metrics = engine.train_batch(train_td, functools.partial(ppo_loss, config=actor))["metrics"]
        if "grad_norm" in metrics:  # verl reports it on the ranks that log (with TP, not every rank)
            record["grad_norm"] = float(metrics["grad_norm"])
    recorder.result["state_bytes"] = state_bytes(engine)
    bucket_bytes = int(spec["bucket_mb"] * (1 << 20))
    buffer = torch.empty(
        bucket_bytes, dtype=torch.uint8, device=get_device_name() if spec["device"] != "cpu" else "cpu"
    )
    for name in ("export", "export_again"):
        with recorder.phase(name) as record:
            record.update(_export(engine, spec["device"], bucket_bytes, buffer), bucket_bytes=bucket_bytes)
    del buffer
    recorder.result["export_digest_trained"] = export_digest(engine)
    trained = _log_probs(engine, infer_td)  # untimed: what offload, onload, save and load must keep
    # what a transition copies: the parameters and the optimizer's state (both engines free the gradient buffers
    # on offload and allocate them zeroed on onload, copying nothing)
    moved = recorder.result["state_bytes"]["params"] + recorder.result["state_bytes"]["optimizer"]
    transitions = (
        ("offload", "cpu"),
        ("onload", get_device_name()),
        ("offload_again", "cpu"),
        ("onload_again", get_device_name()),
    )  # the first step's, then the next step's
    for name, device in transitions if spec.get("transitions", True) else ():
        with recorder.phase(name, bytes=moved):
            engine.to(device)
    if spec["save_contents"]:
        _save_and_load(engine, recorder, work / f"{engine_kind}_checkpoint", spec)
    after = _log_probs(engine, infer_td)
    recorder.result["round_trip"] = {
        "log_probs_equal": bool(torch.equal(after, trained)), "changed_by_training": not torch.equal(trained, old),
    }  # fmt: skip
    recorder.result["distributions"] = loaded_distributions()
    recorder.result["failed_phase"] = None
    recorder.write()


def _save_and_load(engine: Any, recorder: Recorder, saved: Path, spec: dict[str, Any]) -> None:
    """The first save (a process's one-time costs included), the load of it, then the next step's save. With several
    ranks the checkpoint is one (megatron's distributed format, each rank writing its part): its bytes are the
    whole checkpoint's, and one rank removes it once every rank has loaded it."""
    with recorder.phase("save") as record:
        engine.save_checkpoint(str(saved), global_step=1)
    _barrier(spec)
    record["bytes"] = sum(f.stat().st_size for f in files_under(saved))
    record["gb_per_s"] = record["bytes"] / record["seconds"] / GB
    evict(files_under(saved))
    _barrier(spec)
    with recorder.phase("checkpoint_load", bytes=record["bytes"]):
        engine.load_checkpoint(str(saved), del_local_after_load=False)
    _barrier(spec)
    if _first_rank(spec):
        shutil.rmtree(saved)  # room for the next: a GLM-5 or dense checkpoint with its optimizer is most of the disk
    _barrier(spec)
    with recorder.phase("save_again") as record:
        engine.save_checkpoint(str(saved), global_step=2)
    _barrier(spec)
    record["bytes"] = sum(f.stat().st_size for f in files_under(saved))
    record["gb_per_s"] = record["bytes"] / record["seconds"] / GB


def loaded_distributions() -> dict[str, str]:
    """name -> version of every installed distribution a module of this process was loaded from (the carry
    folder's list): among the distributions that provide the module's top-level name, those whose RECORD lists its
    file, so that a namespace several share (google) names only those whose modules loaded."""
    import importlib.metadata

    providers = importlib.metadata.packages_distributions()
    records: dict[str, set[str]] = {}
    out = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None) or ""
        if "site-packages/" not in file:
            continue
        relative = file.rsplit("site-packages/", 1)[1]
        for name in providers.get(relative.split("/")[0].split(".")[0], []):
            if name not in records:
                records[name] = {str(f) for f in importlib.metadata.distribution(name).files or []}
            if relative in records[name]:
                out[name] = importlib.metadata.version(name)
    return dict(sorted(out.items()))


def child_main(engine_kind: str, spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    out = Path(spec["work"]) / f"{engine_kind}{rank_suffix(spec)}.json"
    try:
        run_engine(engine_kind, spec, out)
    except BaseException:
        result = json.loads(out.read_text()) if out.exists() else {"failed_phase": "setup"}
        result["error"] = traceback.format_exc()
        out.write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
        raise
    return 0


# --- the parent -------------------------------------------------------------------------------------------------------
def run_child(engine_kind: str, spec_path: Path, work: Path, timeout: float) -> dict[str, Any]:
    """One engine's run: a process, or torchrun's ranks (``--tp`` / ``--ep``), all working at once; the record of
    rank 0 with every rank's phases under ``ranks``. A time limit ends the whole process group."""
    from verl_npu import processes

    spec = json.loads(spec_path.read_text())
    world = world_size(spec)
    outs = (
        [work / f"{engine_kind}.json"] if world == 1 else [work / f"{engine_kind}.rank{r}.json" for r in range(world)]
    )
    for out in outs:
        out.unlink(missing_ok=True)
    script = [str(Path(__file__).resolve()), "--child", engine_kind, "--spec", str(spec_path)]
    launcher = [] if world == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join(filter(None, [
        str(REPO), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    log = work / f"{engine_kind}.log"
    with open(log, "wb") as sink:  # written as it runs: a run the device's time limit ends still leaves its log
        proc = subprocess.Popen([sys.executable, *launcher, *script], stdout=sink, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            returncode: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            processes.end_group(proc)  # torchrun's ranks with it
            returncode = None
        except BaseException:
            processes.end_group(proc, grace=0.5)
            raise
    results = [json.loads(out.read_text()) if out.exists() else {"failed_phase": "setup"} for out in outs]
    failed = [(rank, r) for rank, r in enumerate(results) if r.get("failed_phase") or r.get("error")]
    if returncode != 0 or failed:
        why = "timed out" if returncode is None else f"exit {returncode}"
        if world == 1 or not failed:
            result = results[0]
            raise PhaseFailed(
                f"{engine_kind} engine failed in phase {result.get('failed_phase') or 'after its last phase'} "
                f"({why}); log {log}:\n{result.get('error') or log.read_text(errors='replace')[-4000:]}"
            )
        # every failed rank: one rank's error often ends the others' collectives, which then fail too
        lines = [f"rank {rank}: phase {r.get('failed_phase') or 'after its last phase'}: "
                 f"{(r.get('error') or 'no traceback').strip().splitlines()[-1]}" for rank, r in failed]  # fmt: skip
        tracebacks = "\n".join(f"--- rank {rank}\n{(r.get('error') or '')[-2000:]}" for rank, r in failed)
        raise PhaseFailed(f"{engine_kind} engine failed on {len(failed)} of {world} ranks ({why}); log {log}:\n"
                          + "\n".join(lines) + "\n" + tracebacks)  # fmt: skip
    if world > 1:
        results[0]["ranks"] = [{"rank": rank, "phases": r["phases"]} for rank, r in enumerate(results)]
    return results[0]


def checkpoint_digest(files: list[Path]) -> dict[str, dict[str, Any]]:
    """The HF checkpoint's tensors as :func:`export_digest` describes exported ones."""
    import torch
    from safetensors import safe_open

    out = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
                tensor = f.get_tensor(name)
                out[name] = {
                    "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                    "bytes": tensor.nbytes,
                    "sha256": hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest(),
                }  # fmt: skip
    return out


def _differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(name for name in set(a) | set(b) if a.get(name) != b.get(name))


def compare(results: dict[str, dict[str, Any]], work: Path, checkpoint: dict[str, Any] | None) -> dict[str, Any]:
    """The engines' exports (of the loaded model: against each other and the checkpoint; after the training step:
    against each other) and their log-probs of the loaded model."""
    import torch

    ours, theirs = (results[e]["export_digest_loaded"] for e in ENGINES)
    differing = _differing(ours, theirs)
    trained = _differing(*(results[e]["export_digest_trained"] for e in ENGINES))
    log_probs = {engine: torch.load(work / f"{engine}_log_probs.pt") for engine in ENGINES}
    difference = (log_probs["ours"] - log_probs["verl"]).abs()
    return {
        "exports_identical": not differing, "exports_differing": differing[:20], "exported_tensors": len(ours),
        "exports_equal_checkpoint": None if checkpoint is None else {e: not _differing(
            results[e]["export_digest_loaded"], checkpoint) for e in ENGINES},
        "trained_exports_identical": not trained, "trained_exports_differing": trained[:20],
        "log_probs_max_abs_difference": difference.max().item(),
        # verl's time over ours: how many times faster ours is (the targets say "at least 2x verl's engine")
        "speed_ours_over_verl": {
            phase: results["verl"]["phases"][phase]["seconds"] / results["ours"]["phases"][phase]["seconds"]
            for phase in PHASES if phase in results["ours"]["phases"] and phase in results["verl"]["phases"]
        },
        "log_probs_max_abs": max(lp.abs().max().item() for lp in log_probs.values()),
        "log_probs_shape": list(log_probs["ours"].shape),
    }  # fmt: skip


def _table(result: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=f"RL step phases: {result['model']['name']} on {result['device']['name']}")
    for column in ("phase", "ours s", "ours GB/s", "verl s", "verl GB/s", "ours/verl speed", "limit", "ours of limit",
                   "verl of limit"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("phase", "limit") else "right")
    limits = result["limits"]
    for phase in PHASES:
        cells = [phase]
        records = [result["engines"][e]["phases"].get(phase, {}) for e in ENGINES]
        for record in records:
            cells += [f"{record['seconds']:.3f}", _rate(record)] if record else ["skipped", "-"]
        ratio = records[1].get("seconds", 0) / records[0]["seconds"] if records[0].get("seconds") else float("nan")
        limit = LIMIT_OF.get(phase)
        cells += [f"{ratio:.2f}", f"{limit} {limits[limit]['gb_per_s']:.2f} GB/s" if limit else "-"]
        for record in records:
            rate = record.get("gb_per_s")
            cells.append(f"{rate / limits[limit]['gb_per_s']:.0%}" if limit and rate else "-")
        table.add_row(*cells)
    return table


def _ranks_table(result: dict[str, Any]) -> Any:
    """Each rank's seconds and rate for each phase, both engines (all ranks ran each phase at once)."""
    from rich.table import Table

    sizes = result["sizes"]
    table = Table(title=f"per rank, TP {sizes['tp']} x EP {sizes['ep']}, every rank at once")
    table.add_column("phase")
    for engine in ENGINES:
        for rank in result["engines"][engine]["ranks"]:
            table.add_column(f"{engine} rank {rank['rank']}", justify="right")
    for phase in PHASES:
        cells = [phase]
        for engine in ENGINES:
            for rank in result["engines"][engine]["ranks"]:
                record = rank["phases"].get(phase)
                cells.append(f"{record['seconds']:.3f} s, {_rate(record)}" if record else "skipped")
        table.add_row(*cells)
    return table


def _rate(record: dict[str, Any]) -> str:
    if record.get("gb_per_s"):
        return f"{record['gb_per_s']:.2f}"
    if record.get("tokens"):
        return f"{record['tokens'] / record['seconds']:.0f} tok/s"
    return "-"


def device_facts(device: str) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {"kind": device, "host": platform.node(), "cpus": os.cpu_count()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        facts |= {"name": props.name, "memory_bytes": props.total_memory}
    else:
        facts["name"] = platform.processor() or platform.machine()
    return facts


def source_digest() -> str:
    """SHA-256 over the repository's Python files under verl_npu/ and bench/ (path and bytes): which code ran, where
    the machine's git metadata may lag the files it was sent (the device copies the working tree)."""
    digest = hashlib.sha256()
    for path in sorted([*REPO.joinpath("verl_npu").rglob("*.py"), *REPO.joinpath("bench").rglob("*.py")]):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _versions() -> dict[str, str]:
    from verl_npu.parity.job import versions

    return {**versions(), "verl-npu sources sha256": source_digest()}


def _check_disk(work: Path, model: str, tiny: bool, save_contents: list[str], writes_checkpoint: bool) -> None:
    """Refuse before building when the work directory cannot hold the HF checkpoint and one engine's saved
    checkpoint (each engine's is removed once it has been measured)."""
    params = rl_step_models.parameter_count(model, tiny)
    saved_per_param = (2 if {"model", "hf_model"} & set(save_contents) else 0) + (
        12 if "optimizer" in save_contents else 0
    )
    needed = params * ((2 if writes_checkpoint else 0) + saved_per_param)  # bf16; fp32 main parameters and moments
    free = shutil.disk_usage(work).free
    if needed > free:
        raise SystemExit(
            f"--work {work}: about {needed / GB:.0f} GB needed (the HF checkpoint and a saved checkpoint with "
            f"{','.join(save_contents)}), {free / GB:.0f} GB free; give --work on a larger disk, or save less "
            "(--save-contents model,extra or none)"
        )


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=rl_step_models.MODELS)
    parser.add_argument("--fp8", action="store_true", help="the checkpoint in FP8 block format (GLM-5 only)")
    parser.add_argument("--tiny", action="store_true", help="the CPU-sized models (a check of the script)")
    parser.add_argument("--out", type=Path, help="the JSON to write")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=None, help="sequences per micro-batch (2 tiny, 1)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (32 tiny, 2048)")
    parser.add_argument("--bucket-mb", type=float, default=2048, help="verl's update_weights_bucket_megabytes")
    parser.add_argument(
        "--save-contents",
        default="model,optimizer,extra",
        help="verl's checkpoint save_contents; none: no save and checkpoint_load phases",
    )
    parser.add_argument("--work", type=Path, default=None, help="checkpoints and logs (default: a new temp dir)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="an HF checkpoint rl_step_models.py wrote")
    parser.add_argument("--without-driver", action="store_true", help="stand in for verl's driver stack")
    parser.add_argument(
        "--verl-first",
        action="store_true",
        help="run verl's engine before ours (the disk and page cache each meets depend on the order)",
    )
    parser.add_argument(
        "--no-transitions",
        action="store_true",
        help="leave out offload and onload (their host copies of GLM-5's optimizer take minutes)",
    )
    parser.add_argument(
        "--profile", type=lambda text: [p for p in text.split(",") if p], default=[],
        help="comma-separated phases to run under cProfile (the JSON keeps each one's top functions; the profiler "
        "slows Python-bound phases)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per engine")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size: TP x EP ranks per engine (torchrun)")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size (--model glm5: the dense model has no "
                        "experts); its ranks come from data parallelism")  # fmt: skip
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return args
    if args.model is None or args.out is None:
        parser.error("--model and --out are required")
    if args.fp8 and args.model == "dense":
        parser.error(
            "--fp8 with --model dense: mbridge's Qwen2 bridge reads FP8 codes as values (no dequantisation); "
            "the FP8 load path is GLM-5's (verl_npu/engine/bridges/fp8_safetensors.py): use --model glm5"
        )
    if args.ep > 1 and args.model != "glm5":
        parser.error(f"--ep {args.ep} with --model {args.model}: the dense model has no experts; use --model glm5")
    for key in ("micro_batches", "micro_batch_size", "seq", "bucket_mb", "tp", "ep"):
        value = getattr(args, key)
        if value is not None and value <= 0:
            parser.error(f"--{key.replace('_', '-')} {value}: give a positive number")
    phases = set(PHASES)
    if set(args.profile) - phases:
        parser.error(f"--profile {','.join(args.profile)}: {sorted(set(args.profile) - phases)} are not phases; "
                     f"choose from {', '.join(sorted(phases))}")  # fmt: skip
    unknown = set(args.save_contents.split(",")) - {"model", "optimizer", "extra", "hf_model", "none"}
    if unknown:
        parser.error(f"--save-contents {args.save_contents}: {sorted(unknown)} are not verl's (model, optimizer, "
                     "extra, hf_model)")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        return child_main(args.child, args.spec)
    import torch
    from rich.console import Console

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ranks = args.tp * args.ep
    if device == "cuda" and ranks > torch.cuda.device_count():
        raise SystemExit(f"--tp {args.tp} --ep {args.ep}: {ranks} ranks, one per device, and this machine has "
                         f"{torch.cuda.device_count()} (the CPU runs them on gloo: a check, not a figure)")  # fmt: skip
    work = args.work or Path(tempfile.mkdtemp(prefix="rl_step_"))
    work.mkdir(parents=True, exist_ok=True)
    save_contents = [] if args.save_contents == "none" else args.save_contents.split(",")
    _check_disk(work, args.model, args.tiny, save_contents, writes_checkpoint=args.checkpoint is None)
    checkpoint = args.checkpoint
    written_seconds = None
    if checkpoint is None:
        checkpoint = work / f"hf_{args.model}{'_tiny' if args.tiny else ''}{'_fp8' if args.fp8 else ''}"
        started = time.perf_counter()
        rl_step_models.write(args.model, checkpoint, tiny=args.tiny, fp8=args.fp8)
        written_seconds = time.perf_counter() - started
    files = rl_step_models.safetensors_files(checkpoint)
    if not files:
        raise SystemExit(f"--checkpoint {checkpoint}: no *.safetensors files (write one with bench/rl_step_models.py)")
    config = json.loads((checkpoint / "config.json").read_text())
    checkpoint_bytes = sum(f.stat().st_size for f in files)
    limits = measure_limits(files, device, COPY_BYTES[device], work)
    spec = {
        "model": args.model, "tiny": args.tiny, "fp8": args.fp8, "device": device, "checkpoint": str(checkpoint),
        "work": str(work), "vocab_size": config["vocab_size"], "seq": args.seq or (32 if args.tiny else 2048),
        "micro_batch_size": args.micro_batch_size or (2 if args.tiny else 1), "micro_batches": args.micro_batches,
        "bucket_mb": args.bucket_mb, "save_contents": save_contents, "without_driver": args.without_driver,
        "transitions": not args.no_transitions, "profile": args.profile, "tp": args.tp, "ep": args.ep,

    }  # fmt: skip
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2) + "\n")
    engines = {}
    order = ENGINES[::-1] if args.verl_first else ENGINES
    for engine in order:
        engines[engine] = run_child(engine, spec_path, work, args.timeout)
        shutil.rmtree(work / f"{engine}_checkpoint", ignore_errors=True)  # measured: its bytes are in the record
    result = {
        "benchmark": "rl_step", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": device_facts(device), "versions": _versions(),
        "model": {
            "name": args.model, "tiny": args.tiny, "fp8": args.fp8, "parameters": rl_step_models.parameter_count(
                args.model, args.tiny), "checkpoint": str(checkpoint), "checkpoint_bytes": checkpoint_bytes,
            "checkpoint_files": len(files), "written_seconds": written_seconds, "config": config,
        },
        "sizes": {k: spec[k] for k in ("seq", "micro_batch_size", "micro_batches", "bucket_mb", "save_contents",
                                       "tp", "ep")},
        "order": list(order), "profiled": args.profile,
        "limits": limits, "engines": engines,
        "compare": compare(engines, work, None if args.fp8 else checkpoint_digest(files)),
    }  # fmt: skip
    for record in engines.values():
        for phase, value in record["phases"].items():
            limit = LIMIT_OF.get(phase)
            if limit and value.get("gb_per_s"):
                value["fraction_of_limit"] = value["gb_per_s"] / limits[limit]["gb_per_s"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    console = Console(width=max(Console().width, 150))
    console.print(_table(result))
    if ranks > 1:
        console.print(_ranks_table(result))
    compared = result["compare"]
    console.print(f"exports identical: {compared['exports_identical']} ({compared['exported_tensors']} tensors); "
                    f"old-log-prob max |ours - verl|: {compared['log_probs_max_abs_difference']:.3g}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
