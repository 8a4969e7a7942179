"""A launch's start-up: the checkpoint bytes each node reads, how long the load takes, and the HCCL timeouts it needs.

verl-npu's engine loads the HF checkpoint the way mbridge decides who reads what (verl_npu/engine/bridges/fast_load.py):
tensor-parallel rank 0 of each pipeline stage reads every non-expert tensor of its stage's layers whole and scatters
the shards over its TP group; expert-TP rank 0 of each expert-parallel rank reads its local experts; every TP rank of
the last stage reads ``lm_head``; TP rank 0 of the first stage reads the embedding. A node reads the union of what its
ranks load. The engine's prefetch (fast_read.prefetch) runs only on a LOCAL_RANK 0 that loads the
whole checkpoint itself (one pipeline stage, no expert parallelism, TP and expert-TP rank 0:
verl_engine.loads_whole_checkpoint): it reads that node's bytes early, overlapping the build, and adds none.

The load's time is the node's bytes over the node's disk rate times :data:`ENGINE_SHARE_OF_DISK_RATE`, the share of
the disk's rate that the engine's build plus load reached on the nvidia-h200 (docs/preflight_startup.md). The first
collectives wait for the slowest rank's build and load: TP ranks other than 0 sit in the scatter while rank 0
reads. So HCCL_CONNECT_TIMEOUT and HCCL_EXEC_TIMEOUT must exceed that time, with :data:`SAFETY_FACTOR` and
:data:`BUILD_ALLOWANCE_S`; a value far above it (:data:`FAR_ABOVE_FACTOR`) is a warning, because a hung rank then
takes that long to be noticed. docs/preflight_startup.md derives each number.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verl_npu import inputs
from verl_npu.bounded_read import MIB, NotReadable, read_bytes
from verl_npu.checks import FAIL, OK, WARN, Check
from verl_npu.inputs import InputError
from verl_npu.parallelism import Parallelism
from verl_npu.preflight import unknowns
from verl_npu.preflight.model_shape import ModelShape
from verl_npu.safetensors_header import CheckpointFileError, read_header

GB = 10**9  # rates are GB/s of 10**9 bytes, as bench/rl_step.py and `cat`-style tools report them
GiB = 2**30

# the engine's build plus HF load against `cat`'s rate on the nvidia-h200, the slowest of the committed runs
# (engines.ours.phases.load.fraction_of_limit: dense 0.614, GLM-5 bf16 0.641, GLM-5 FP8 0.617 in bench/results/
# rl_step_*_h200.json), rounded down; tests_npu/preflight/test_preflight_startup.py keeps it so.
ENGINE_SHARE_OF_DISK_RATE = 0.61
SAFETY_FACTOR = 2.0  # the rate a node gets when every node reads at once is rarely what one node measured alone
BUILD_ALLOWANCE_S = 60  # what differs between ranks besides the load: the build's skew (docs/preflight_startup.md)
FAR_ABOVE_FACTOR = 10  # a timeout this many times the minimum leaves a hung rank unnoticed for that long
PLAUSIBLE_MAX_GBPS = 50.0  # above a node's NVMe array and its network links: most likely a unit mix-up
PREFETCH_SHARE_OF_AVAILABLE = 0.5  # verl_npu/engine/bridges/fast_read.py's, quoted in the report (the test reads it)
SAMPLE_BYTES = GiB  # the cold read sample: at most this much of one file ...
SAMPLE_CHUNK = MIB  # ... in reads of this size, as `cat` reads
MIN_TRUSTED_SAMPLE = 64 * MIB  # a smaller sample times the system calls, not the disk
MAX_INDEX_BYTES = 64 * MIB  # model.safetensors.index.json (GLM-5.2's is about 8 MB)

# HCCL's timeouts, as CANN documents them for Atlas A2 / A3 (docs/preflight_startup.md): whole seconds
CONNECT, EXEC = "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT"
TIMEOUTS = {CONNECT: (120, 7200, 120), EXEC: (0, 2**31 - 1, 1836)}  # (minimum, maximum, CANN's default)
AIV_EXEC_CAP_S = 1091  # HCCL_OP_EXPANSION_MODE=AIV caps the execution timeout (0 and larger values read as 1091)


class CheckpointError(ValueError):
    """A local checkpoint whose index or headers cannot be what they claim."""


# --- what the checkpoint holds --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Storage:
    """How the checkpoint stores a parameter: bytes of a plain one, and of a quantised projection weight."""

    name: str  # "bf16", "fp32", "fp8 e4m3, 128x128 block scales"
    plain_bytes: float
    quantised_bytes: float  # FP8: 1 byte + a 4-byte float32 scale per block

    @classmethod
    def of(cls, hf: Mapping[str, Any]) -> Storage:
        """From the HF config: ``quantization_config`` (FP8 block), else the ``torch_dtype`` / ``dtype``."""
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
        plain = 4.0 if str(dtype).removeprefix("torch.") == "float32" else 2.0
        quant = hf.get("quantization_config")
        if isinstance(quant, Mapping) and quant.get("quant_method") == "fp8":
            block = quant.get("weight_block_size") or [128, 128]
            key = "quantization_config.weight_block_size"
            if not isinstance(block, list | tuple) or len(block) != 2:
                raise InputError(key, block, "two integers, the rows and columns of a scale's block")
            rows, cols = (inputs.integer(f"{key}[{i}]", b, minimum=1, maximum=1 << 20) for i, b in enumerate(block))
            fmt = quant.get("fmt", "e4m3")
            return cls(f"fp8 {fmt}, {rows}x{cols} block scales", 2.0, 1.0 + 4.0 / (rows * cols))
        return cls("fp32" if plain == 4.0 else "bf16", plain, plain)


@dataclasses.dataclass(frozen=True)
class ModelBytes:
    """The checkpoint's bytes by what reads them, from the model's shape."""

    layer_non_expert: tuple[float, ...]  # per layer: what TP rank 0 of its stage reads
    layer_per_expert: tuple[float, ...]  # per layer: one routed expert (0 on dense layers)
    embedding: float
    head: float  # lm_head (0 when tied to the embedding)
    final_norm: float
    num_experts: int

    @property
    def total(self) -> float:
        experts = sum(self.layer_per_expert) * self.num_experts
        return sum(self.layer_non_expert) + experts + self.embedding + self.head + self.final_norm


def model_bytes(shape: ModelShape, storage: Storage) -> ModelBytes:
    """Bytes of each part of the checkpoint. In an FP8 block checkpoint (DeepSeek-V3's and GLM-5's releases) every 2-D
    projection is quantised (block edges are not counted: under 0.01% of GLM-5's bytes); the norms, the embedding,
    the LM head, the MoE router and the DSA indexer's head weights stay plain (bench/rl_step_models.py writes them
    so)."""
    h = shape.hidden_size
    non_expert, per_expert = [], []
    for layer in range(shape.num_layers):
        params = shape.layer_params(layer)
        plain = 2 * h  # the two layer norms
        if shape.mla:
            plain += (shape.q_lora_rank or 0) + (shape.kv_lora_rank or 0)  # q_a / kv_a norms
        elif shape.qk_layernorm:
            plain += 2 * shape.head_dim
        if shape.dsa and shape.full_indexer(layer):
            plain += 2 * shape.index_head_dim + h * shape.index_n_heads  # k_norm, weights_proj
        moe = bool(shape.is_moe and shape.is_moe[layer])
        if moe:
            plain += shape.num_experts * h  # router
        quantised = params.dense - plain
        non_expert.append(quantised * storage.quantised_bytes + plain * storage.plain_bytes)
        per_expert.append(params.expert / shape.num_experts * storage.quantised_bytes if moe else 0.0)
    return ModelBytes(
        tuple(non_expert),
        tuple(per_expert),
        shape.embedding_params() * storage.plain_bytes,
        shape.output_params() * storage.plain_bytes,
        h * storage.plain_bytes,
        shape.num_experts,
    )


# --- who reads what -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NodeRead:
    node: int
    stages: tuple[int, ...]
    bytes: float


def node_reads(shape: ModelShape, parts: ModelBytes, mesh: Parallelism, ranks_per_node: int) -> list[NodeRead]:
    """The bytes each node's ranks load (the union over its ranks), as fast_load.load_weights decides who reads.

    Ranks follow megatron-core 0.18's order "tp-cp-ep-dp-pp" (pipeline outermost; the expert decomposition
    etp-ep-edp-pp inside a stage), and verl places ranks node by node (``ranks_per_node`` consecutive ranks). Local
    experts of EP rank e are experts [e * E / EP, (e + 1) * E / EP). Layers per stage are megatron's contiguous
    split with the first/last-stage overrides (VPP chunks hold the same layers' bytes in other places).
    """
    world, pp, per_stage = mesh.devices, mesh.pp, mesh.ranks_per_stage
    counts = mesh.stage_layers(shape.num_layers)
    starts = [sum(counts[:s]) for s in range(pp)]
    stage_non_expert = [sum(parts.layer_non_expert[starts[s] : starts[s] + counts[s]]) for s in range(pp)]
    stage_per_expert = [sum(parts.layer_per_expert[starts[s] : starts[s] + counts[s]]) for s in range(pp)]
    local_experts = shape.num_experts // mesh.ep if shape.num_experts else 0
    tied_head = parts.embedding if shape.tie_word_embeddings and pp > 1 else 0.0  # the last stage's copy
    out = []
    for node, first in enumerate(range(0, world, ranks_per_node)):
        reads_stage: set[int] = set()
        ep_ranks: dict[int, set[int]] = {}  # stage -> the EP ranks of this node that read its experts
        head_readers = False
        for rank in range(first, min(first + ranks_per_node, world)):
            stage, inside = divmod(rank, per_stage)
            if inside % mesh.tp == 0:
                reads_stage.add(stage)  # TP rank 0: the stage's non-expert tensors
            if inside % mesh.etp == 0:
                ep_ranks.setdefault(stage, set()).add((inside // mesh.etp) % mesh.ep)
            head_readers |= stage == pp - 1  # every TP rank reads lm_head ("lm_head.weight" in its names)
        total = sum(stage_non_expert[s] for s in reads_stage)
        total += sum(len(eps) * local_experts * stage_per_expert[s] for s, eps in ep_ranks.items())
        total += parts.embedding if 0 in reads_stage else 0.0
        total += parts.final_norm + tied_head if pp - 1 in reads_stage else 0.0
        total += parts.head if head_readers else 0.0
        out.append(NodeRead(node, tuple(sorted({r // per_stage for r in range(first, first + ranks_per_node)
                                                if r < world})), total))  # fmt: skip
    return out


def pre_reading_nodes(mesh: Parallelism, ranks_per_node: int) -> int:
    """How many nodes' LOCAL_RANK 0 loads the whole checkpoint itself, so that the engine prefetches it during the
    build (verl_engine.loads_whole_checkpoint: one stage, EP 1, TP and expert-TP rank 0). Such a node's ranks load the
    whole checkpoint anyway: the prefetch moves its read earlier, it adds no bytes."""
    if mesh.pp != 1 or mesh.ep != 1:
        return 0
    return sum(1 for first in range(0, mesh.devices, ranks_per_node) if first % mesh.tp == 0 and first % mesh.etp == 0)


# --- a checkpoint on this machine -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LocalCheckpoint:
    directory: Path
    bytes: int  # the tensors' bytes
    source: str  # where the count came from, for the report
    largest_file: Path | None


def local_checkpoint(directory: str | os.PathLike[str]) -> LocalCheckpoint | None:
    """The checkpoint's bytes from its index's ``metadata.total_size``, else from every file's header (the files'
    data are never read). None when ``directory`` holds no safetensors checkpoint; CheckpointError when it holds a
    broken one."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    files = sorted(directory.glob("*.safetensors"))
    largest = max(files, key=lambda f: f.stat().st_size) if files else None
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            data = json.loads(read_bytes(index, MAX_INDEX_BYTES))
        except (NotReadable, ValueError, RecursionError) as exc:
            raise CheckpointError(f"{index}: not a readable safetensors index ({exc})") from None
        total = data.get("metadata", {}).get("total_size") if isinstance(data, dict) else None
        if total is not None:
            try:
                size = inputs.integer("metadata.total_size", total, minimum=1, maximum=1 << 60, source=str(index))
            except InputError as exc:
                raise CheckpointError(str(exc)) from None
            return LocalCheckpoint(directory, size, f"{index.name} metadata.total_size", largest)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if isinstance(weight_map, dict):
            files = [directory / name for name in sorted(set(map(str, weight_map.values())))]
    if not files:
        return None
    total = sum(_header_data_bytes(f) for f in files)
    return LocalCheckpoint(directory, total, f"the headers of {len(files)} safetensors file(s)", largest)


def _header_data_bytes(path: Path) -> int:
    """The bytes of the tensors a safetensors file's header declares (only the header is read, checked as the
    engine's load checks it)."""
    try:
        entries, _ = read_header(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror or exc}") from None
    except CheckpointFileError as exc:
        raise CheckpointError(str(exc)) from None
    return sum(end - begin for begin, end in (entry["offsets"] for entry in entries.values()))


@dataclasses.dataclass(frozen=True)
class ReadSample:
    file: Path
    bytes: int
    seconds: float
    cold: bool  # posix_fadvise(DONTNEED) dropped the file's cached pages first

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / GB


def sample_read_rate(path: Path, limit: int = SAMPLE_BYTES) -> ReadSample:
    """Read up to ``limit`` bytes of ``path`` in SAMPLE_CHUNK reads, as `cat` does, after dropping its cached pages
    (POSIX_FADV_DONTNEED: clean pages no process maps), so that the disk, not the page cache, answers."""
    buffer = bytearray(SAMPLE_CHUNK)
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY)
    try:
        cold = hasattr(os, "posix_fadvise")
        if cold:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        done, start = 0, time.perf_counter()
        while done < limit:
            got = os.readv(fd, [view[: min(SAMPLE_CHUNK, limit - done)]])
            if got == 0:
                break
            done += got
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    return ReadSample(path, done, max(seconds, 1e-9), cold)


# --- the estimate ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StartupEstimate:
    nodes: int
    ranks_per_node: int
    storage: str
    checkpoint_bytes: int
    checkpoint_source: str
    busiest: NodeRead  # the node whose ranks load the most (the union of its ranks' shards)
    pre_read_nodes: int  # nodes where the engine prefetches the checkpoint during the build (pre_reading_nodes)
    read_gbps: float | None  # the node's disk rate; None: unknown
    rate_source: str

    @property
    def shard_bytes(self) -> int:
        return round(self.busiest.bytes)

    @property
    def reads(self) -> str:
        """What a node reads, and where the engine's prefetch runs (it adds no bytes)."""
        text = "the union of its ranks' shards"
        if self.pre_read_nodes:
            text += (
                f"; PP=1 and EP=1: on the {self.pre_read_nodes} of {self.nodes} node(s) whose LOCAL_RANK 0 loads the "
                "whole checkpoint, the engine prefetches it into host memory during the build (when it is under "
                f"{PREFETCH_SHARE_OF_AVAILABLE:g} of MemAvailable), overlapping the read with the build: the bytes are "
                "the same"
            )
        return text

    def load_seconds(self) -> float | None:
        if self.read_gbps is None:
            return None
        return self.shard_bytes / (self.read_gbps * GB * ENGINE_SHARE_OF_DISK_RATE)

    def minimum_timeout(self) -> int | None:
        """The smallest HCCL timeout that lets the first collectives wait for the slowest node's load."""
        seconds = self.load_seconds()
        return None if seconds is None else math.ceil(SAFETY_FACTOR * seconds + BUILD_ALLOWANCE_S)

    def derivation(self) -> str:
        return (
            f"{_gb(self.shard_bytes)} at {self.read_gbps:g} GB/s x {ENGINE_SHARE_OF_DISK_RATE}, the engine's "
            f"measured share of the disk rate, = {self.load_seconds():,.0f} s to load; x {SAFETY_FACTOR:g} (safety) "
            f"+ {BUILD_ALLOWANCE_S} s (the build's skew) = {self.minimum_timeout()} s"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "storage": self.storage,
            "checkpoint_bytes": self.checkpoint_bytes,
            "checkpoint_source": self.checkpoint_source,
            "busiest_node": self.busiest.node,
            "busiest_node_stages": list(self.busiest.stages),
            "shard_bytes_per_node": self.shard_bytes,
            "reads": self.reads,
            "pre_read_nodes": self.pre_read_nodes,
            "read_gbps": self.read_gbps,
            "rate_source": self.rate_source,
            "engine_share_of_disk_rate": ENGINE_SHARE_OF_DISK_RATE,
            "safety_factor": SAFETY_FACTOR,
            "build_allowance_s": BUILD_ALLOWANCE_S,
            "load_seconds": self.load_seconds(),
            "minimum_timeout_s": self.minimum_timeout(),
        }


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:,.1f} GB"


def read_rate(gbps: Any) -> float | None:
    """``--checkpoint-read-gbps``: a finite number of GB/s > 0 (None: not given). Raises InputError."""
    return None if gbps is None else inputs.number("--checkpoint-read-gbps", gbps, above=0)


def estimate_startup(
    shape: ModelShape,
    hf: Mapping[str, Any],
    mesh: Parallelism,
    ranks_per_node: int,
    *,
    read_gbps: float | None,
    checkpoint_dir: str | None,
) -> tuple[StartupEstimate, list[Check]]:
    """The start-up estimate, and its checks: the checkpoint's bytes, the rate and its source, the load."""
    checks: list[Check] = []
    try:
        storage = Storage.of(hf)
    except InputError as exc:
        checks.append(Check("startup.checkpoint", FAIL, f"model config: {exc}", "give weight_block_size as [128, 128]"))
        storage = Storage("bf16", 2.0, 2.0)
    parts = model_bytes(shape, storage)
    modelled = parts.total
    local = None
    if checkpoint_dir is not None:
        try:
            local = local_checkpoint(checkpoint_dir)
        except CheckpointError as exc:
            checks.append(Check("startup.checkpoint", WARN, f"{exc}; the estimate counts the model's shape instead",
                                "the engine's load reads the same files: repair the checkpoint"))  # fmt: skip
    reads = node_reads(shape, parts, mesh, ranks_per_node)
    if local is not None and modelled > 0:  # the real bytes, shared out over the nodes as the shape shares them
        scale = local.bytes / modelled
        reads = [dataclasses.replace(r, bytes=r.bytes * scale) for r in reads]
        checkpoint_bytes, source = local.bytes, f"{local.directory}: {local.source}"
    else:
        checkpoint_bytes = round(modelled)
        source = f"the model's shape at {storage.name}: {shape.total_params() / 1e9:,.1f}B parameters, no MTP layers"
    busiest = max(reads, key=lambda r: r.bytes)
    gbps, rate_source, rate_check = _rate(read_gbps, local)
    estimate = StartupEstimate(len(reads), ranks_per_node, storage.name, checkpoint_bytes, source, busiest,
                               pre_reading_nodes(mesh, ranks_per_node), gbps, rate_source)  # fmt: skip
    checks.append(rate_check)
    reads_what = f"node {busiest.node} (stages {list(busiest.stages)}) reads the most, {_gb(estimate.shard_bytes)}"
    detail = f"checkpoint {_gb(checkpoint_bytes)} ({source}); each node reads {estimate.reads}; {reads_what}"
    if gbps is not None:
        detail += f"; {estimate.derivation()}"
    checks.append(Check("startup.load", OK, detail))
    return estimate, checks


def _rate(read_gbps: float | None, local: LocalCheckpoint | None) -> tuple[float | None, str, Check]:
    """The node's disk rate, where it came from, and its check."""
    flag = "--checkpoint-read-gbps"
    if read_gbps is not None:
        source = f"{flag} {read_gbps:g} (the operator's measured rate per node)"
        if read_gbps > PLAUSIBLE_MAX_GBPS:
            return read_gbps, source, Check(
                "startup.read-rate", WARN,
                f"{flag} {read_gbps:g} GB/s is above any node's disk or network rate ({PLAUSIBLE_MAX_GBPS:g} GB/s): "
                "the start-up estimate and the timeouts below are computed with it",
                "give the rate in GB/s (10**9 bytes a second) that one node reads while every node reads at once",
            )  # fmt: skip
        return read_gbps, source, Check("startup.read-rate", OK, f"checkpoint read rate: {source}")
    if local is not None and local.largest_file is not None:
        try:
            sample = sample_read_rate(local.largest_file)
        except OSError as exc:
            why = f"the local checkpoint's {local.largest_file.name} could not be read ({exc.strerror or exc})"
        else:
            if sample.bytes > 0:
                how = "cold: its cached pages dropped first" if sample.cold else "no posix_fadvise here: maybe cached"
                source = (f"sampled on this host: {sample.bytes / MIB:,.0f} MiB of {sample.file.name} in "
                          f"{sample.seconds:.3f} s ({how})")  # fmt: skip
                fix = f"this host may not read as the cluster's nodes do: pass {flag} with the nodes' measured rate"
                status = OK if sample.bytes >= MIN_TRUSTED_SAMPLE else WARN
                if status == WARN:
                    small = f"a sample under {MIN_TRUSTED_SAMPLE // MIB} MiB times the system calls, not the disk"
                    fix = f"{small}: {fix}"
                return (
                    sample.gbps,
                    source,
                    Check("startup.read-rate", status, f"checkpoint read rate {sample.gbps:.3g} GB/s, {source}", fix),
                )
            why = f"the local checkpoint's {local.largest_file.name} is empty"
    else:
        why = "the checkpoint is not on this machine"
    return None, "unknown", Check(
        "startup.read-rate", WARN,
        f"checkpoint read rate unknown ({why}): the load's time and the HCCL timeouts it needs are not estimated",
        f"pass {flag} GBPS, the rate one node reads the checkpoint's storage at while every node reads (e.g. "
        "`cat` of a checkpoint file on every node at once, bytes over seconds)",
    )  # fmt: skip


# --- the timeouts ---------------------------------------------------------------------------------------------
def timeout_checks(estimate: StartupEstimate | None, env: Mapping[str, str]) -> list[Check]:
    """HCCL_CONNECT_TIMEOUT and HCCL_EXEC_TIMEOUT of the launch's environment against the start-up's minimum.

    Every value is range-checked first (a bad one is a FAIL naming the variable, whatever the estimate); a value is
    then compared only with a minimum that was estimated (no rate: no verdict on it beyond its range)."""
    checks = []
    minimum = estimate.minimum_timeout() if estimate is not None else None
    for name, (low, high, default) in TIMEOUTS.items():
        raw = env.get(name)
        key = f"startup.{name.lower().replace('_', '-')}"
        if raw is not None and unknowns.contains(raw):
            checks.append(Check(key, FAIL, f"{name}={raw!r} is only known when the launch runs",
                                f"write {name} literally in the launch's env file"))  # fmt: skip
            continue
        try:
            value = default if raw is None else inputs.integer(name, raw, minimum=low, maximum=high)
        except InputError as exc:
            fix = f"set {name} to whole seconds from {low} to {high} (CANN refuses or clamps other values)"
            checks.append(Check(key, FAIL, f"{exc} (whole seconds, as CANN documents it for Atlas A2/A3)", fix))
            continue
        if estimate is None or minimum is None:  # minimum is None whenever estimate is
            continue
        checks.append(_against_minimum(name, key, value, raw is None, minimum, estimate.derivation(), env))
    return checks


def _against_minimum(
    name: str, key: str, value: int, unset: bool, minimum: int, derivation: str, env: Mapping[str, str]
) -> Check:
    """``minimum``: the estimate's minimum_timeout; ``derivation``: how the estimate reached it."""
    shown = f"{name} unset (CANN's default, {value} s)" if unset else f"{name}={value} s"
    if (
        name == EXEC
        and env.get("HCCL_OP_EXPANSION_MODE", "").strip() == "AIV"
        and (value == 0 or value > AIV_EXEC_CAP_S)
    ):
        value, shown = AIV_EXEC_CAP_S, f"{shown}, which HCCL_OP_EXPANSION_MODE=AIV caps at {AIV_EXEC_CAP_S} s"
    high = TIMEOUTS[name][1]
    room = f"at least {minimum}"
    if FAR_ABOVE_FACTOR * minimum <= high:
        room += f" and at most {FAR_ABOVE_FACTOR * minimum}"
    why = f"the first collectives wait while the slowest node loads: {derivation}"
    if minimum > high:
        return Check(key, FAIL, f"{shown}: the start-up needs {minimum} s, more than {name} can be ({high} s); {why}",
                     "make the load faster: stage the checkpoint on each node's local disk, or read it from faster "
                     "storage (then pass its rate with --checkpoint-read-gbps)")  # fmt: skip
    if name == EXEC and value == 0:
        return Check(key, WARN, f"{shown}: 0 never times out, so a hung rank is never noticed; {why}",
                     f"set {name} to {room}")  # fmt: skip
    if value < minimum:
        return Check(key, FAIL, f"{shown} is below the {minimum} s the start-up needs; {why}",
                     f"set {name} to {room} in the launch's environment (its env file)")  # fmt: skip
    if not unset and value > FAR_ABOVE_FACTOR * minimum:
        return Check(key, WARN, f"{shown} is over {FAR_ABOVE_FACTOR}x the {minimum} s the start-up needs: a hung "
                     f"rank takes {value} s to be noticed; {why}", f"set {name} to {room}")  # fmt: skip
    return Check(key, OK, f"{shown} covers the {minimum} s the start-up needs; {why}")
