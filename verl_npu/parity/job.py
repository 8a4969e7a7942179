"""``verl-npu parity run``: one deterministic engine-level job, no rollout, the same numbers on every platform.

For each parity model (verl_npu.parity.models) the job writes its checkpoint, builds it the way the verl-npu
Megatron engine builds it for a launch (verl 0.9.1's vanilla-mbridge sequence with the engine's steps from
verl_npu.engine.build: build plan, MindSpeed's repatch on Ascend, the local spec elsewhere, the runtime patches of
verl_npu.megatron_adaptor, DDP with the distributed optimizer, full activation recompute as the GLM-5.2 launch
runs it), then:

1. evaluates a fixed batch (no grad, ``micro_batches`` micro-batches): per-token log-probs, activation checksums
   (verl_npu.parity.probes), every DSA layer's top-k and the block-boundary tensors (verl_npu.parity.replay); with
   ``replay_from``, evaluates it again with every block fed that file's tensors;
2. back-propagates the policy-gradient loss on that batch (the gradient probe, verl_npu.parity.gradients), at its
   own activations and, with ``replay_from``, at the file's: per parameter group, not applied;
3. trains ``steps`` steps on fixed batches with that loss (fixed per-token advantages), recording each step's loss
   and gradient norm and step 0's update against AdamW's on the host, with the engine's offload manager moving
   params, grads and optimizer state to the host and back between steps;
4. evaluates the log-probs again.

fp32 is computed in fp32 (HF32 on Ascend, TF32 on CUDA off: docs/parity.md).

Deterministic: ``torch.use_deterministic_algorithms(True)`` (verl's deterministic mode; every verl-npu op is
bitwise repeatable there or refuses by name), so two runs on one machine agree bit for bit. It runs on the CUDA
reference device without verl's Ray-based driver stack, which that device does not carry; the model it builds is
the one verl's engine builds (tests_npu/parity/test_parity_engine.py checks their log-probs agree on the CPU).

``path``: ``default`` (what a launch gets on this platform: on Ascend MindSpeed's fused DSA operators for the model
whose shapes they take), ``portable`` (verl-npu's portable PyTorch operators only) or ``fused`` (Ascend's fused
DSA operators required).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform as host_platform
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from verl_npu.errors import UserError
from verl_npu.parity.models import (
    DEFAULT_MODELS,
    MODELS,
    REPO_ROOT,
    ParityModel,
    advantages,
    evaluation_tokens,
    training_tokens,
    write_checkpoint,
)
from verl_npu.parity.run_format import DTYPES, FORMAT, MAX_STEPS, RUN_KIND

PATHS = ("default", "portable", "fused")
# step 0's gradients and update are judged; a second step runs on what the offload manager moved to the host and
# back (a summary: later steps' losses diverge chaotically between correct platforms)
DEFAULT_STEPS = 2
LEARNING_RATE = 1e-3


class ParityError(UserError):
    """A parity run that cannot start: an unknown model, dtype or path, or a path this platform has not."""


@dataclasses.dataclass(frozen=True)
class RunOptions:
    models: tuple[str, ...] = DEFAULT_MODELS
    dtype: str = "fp32"
    steps: int = DEFAULT_STEPS
    path: str = "default"
    replay_from: str | None = None  # a run or reference whose natural tensors each block is fed (parity/replay.py)

    def __post_init__(self) -> None:
        from verl_npu import inputs

        unknown = [m for m in self.models if m not in MODELS]
        if unknown or not self.models:
            raise ParityError(f"--model {', '.join(unknown) or '(none)'}: choose from {', '.join(MODELS)}")
        inputs.choice("--dtype", self.dtype, DTYPES)
        inputs.choice("--path", self.path, PATHS)
        inputs.integer("--steps", self.steps, minimum=1, maximum=MAX_STEPS)
        if self.path == "fused" and self.dtype != "bf16":
            raise ParityError(
                f"--path fused --dtype {self.dtype}: MindSpeed's fused DSA kernels cast their inputs to bf16, so the "
                "run would not be computed in its dtype; use --dtype bf16 (or --path default, which takes them in bf16 "
                "runs only)"
            )


# --- the platform -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Device:
    platform: str  # cpu, cuda or ascend (verl_npu.platform)
    name: str  # what the machine calls the device

    @property
    def torch_device(self) -> Any:
        import torch

        if self.platform == "cpu":
            return torch.device("cpu")
        return torch.device("cuda" if self.platform == "cuda" else "npu", 0)


def start_device() -> Device:
    """This process's device in deterministic mode, with a one-rank process group and megatron's parallel state."""
    from verl_npu import platform as platforms

    kind = platforms.detect()
    if kind == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS is deterministic only with it
    elif kind == "ascend":
        os.environ.setdefault("HCCL_DETERMINISTIC", "true")
        os.environ.setdefault("CLOSE_MATMUL_K_SHIFT", "1")
    if kind != "ascend":  # the CUDA reference device and CPU boxes run other torch builds than the Ascend pin
        os.environ.setdefault("VERL_NPU_ALLOW_MISMATCH", "1")
    import torch

    _full_fp32(kind)
    # warn_only: an op without a deterministic kernel (megatron's, torch's) runs and is recorded, never silently;
    # verl-npu's own ops are deterministic there or refuse by name (issue 18), and run-to-run spread is measured
    torch.use_deterministic_algorithms(True, warn_only=True)
    import verl_npu.megatron_adaptor as layer

    layer.load()
    from verl_npu.engine.single_process import init_single_process

    if kind == "cpu":
        from verl_npu.engine import cpu_device

        cpu_device.activate()
        init_single_process("gloo")
        return Device(kind, _cpu_name())
    init_single_process("nccl" if kind == "cuda" else "hccl", device_index=0)
    if kind == "cuda":
        return Device(kind, torch.cuda.get_device_name(0))
    return Device(kind, torch.npu.get_device_name(0))  # type: ignore[attr-defined]  # `import torch_npu` adds it


def _full_fp32(kind: str) -> None:
    """fp32 computed in fp32: Ascend's HF32 and CUDA's TF32 (a 10-bit mantissa inside fp32 matmuls and convolutions)
    off, so an fp32 run is comparable across platforms (docs/parity.md). torch_npu defaults matmul HF32 off and
    convolution HF32 on; torch defaults matmul TF32 off and cuDNN's on: all four are set, whatever the defaults."""
    import torch

    if kind == "ascend":
        # torch.npu is what `import torch_npu` adds to torch; torch's own types cannot know it
        torch.npu.matmul.allow_hf32 = False  # type: ignore[attr-defined]
        torch.npu.conv.allow_hf32 = False  # type: ignore[attr-defined]
    elif kind == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    return "cpu: " + (host_platform.processor() or host_platform.machine())


def versions() -> dict[str, str]:
    out = {"python": host_platform.python_version()}
    for dist in ("torch", "torch-npu", "megatron-core", "mbridge", "transformers", "triton", "verl", "verl-npu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    out["verl-npu commit"] = _commit()[:12]  # provenance, as image tags carry it (a full hash reads as a pin)
    return out


def _commit() -> str:
    if os.environ.get("VERL_NPU_COMMIT"):
        return os.environ["VERL_NPU_COMMIT"]
    from verl_npu import processes

    try:
        done = processes.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], timeout=10)
    except OSError:
        return "unknown"
    return str(done.stdout).strip() if done.ok else "unknown"


# --- the engine -------------------------------------------------------------------------------------------------------
def torch_dtype(dtype: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}[dtype]


def engine_config(model: ParityModel, device: Device, path: str, dtype: str = "bf16") -> dict[str, Any]:
    """The launch-level engine settings (``actor_rollout_ref.actor.megatron``), as the GLM-5.2 example sets them
    where they change numerics; ``allgather`` tokens to the experts on every platform (megatron's alltoall needs
    CUDA streams, and one rank makes the two the same computation). The fp64 run, which only measures fp32's error,
    uses megatron's plain optimizer: its distributed optimizer takes fp32, fp16 and bf16 parameters only (on one
    rank both run the same Adam)."""
    otc: dict[str, Any] = {
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "moe_token_dispatcher_type": "allgather",
        "variable_seq_lengths": False, "recompute_granularity": "full", "recompute_method": "uniform",
        "recompute_num_layers": 1, "use_cpu_initialization": device.platform == "cpu",
    }  # fmt: skip
    if path == "portable":
        otc["use_flash_attn"] = False  # MindSpeed's flash attention (npu_fusion_attention) off; dropped elsewhere
    # MindSpeed's fused DSA kernels compute in bf16 whatever the run's dtype (docs/upstream_facts.md): a wider run
    # takes the PyTorch DSA path, so that it is the computation its dtype names
    fused = path == "fused" or (path == "default" and device.platform == "ascend" and model.fused_dsa
                                and dtype == "bf16")  # fmt: skip
    if fused:
        if device.platform != "ascend":
            raise ParityError(
                f"--path fused: MindSpeed's fused DSA operators run on Ascend only, not {device.platform}"
            )
        if not model.fused_dsa:
            raise ParityError(f"--path fused: model {model.name}'s shapes are not the ones the fused DSA operators "
                              "take; use glm5_2_fused_shape")  # fmt: skip
        from verl_npu.contracts.mindspeed import DSA_SWITCHES  # here: the CLI's parser loads no contract

        otc |= dict.fromkeys(DSA_SWITCHES, True)  # MindSpeed's four DSA switches go on together
    return {
        "vanilla_mbridge": True, "use_distributed_optimizer": dtype != "fp64", "use_remove_padding": False,
        "override_transformer_config": otc,
        # fp64: gradients in fp64 too (megatron reduces them in fp32 by default, which an fp64 parameter refuses)
        "override_ddp_config": {"grad_reduce_in_fp32": False} if dtype == "fp64" else {},
    }  # fmt: skip


CLIP_GRAD = 1.0  # verl's default optim.clip_grad
OPTIMIZER = {"optimizer": "adam", "lr": LEARNING_RATE, "weight_decay": 0.01}


@dataclasses.dataclass
class Built:
    module: list[Any]
    optimizer: Any
    plan: Any
    gpt: Any
    dtype: str
    clip_here: bool = False  # fp64: megatron's clipping takes fp32 gradients only, so the job clips (same formula)


def build(model: ParityModel, checkpoint: Path, device: Device, dtype: str, path: str) -> Built:
    """The model as the verl-npu engine builds it (module docstring), its weights loaded, and its optimizer."""
    from mbridge import AutoBridge
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from transformers import AutoConfig

    from verl_npu.engine import build as engine_build
    from verl_npu.engine.build_plan import build_plan

    hf_config = as_verl_loads_it(AutoConfig.from_pretrained(checkpoint))
    settings = engine_config(model, device, path, dtype)
    distributed = settings["use_distributed_optimizer"]
    plan = build_plan(settings, {"lr": LEARNING_RATE}, hf_config, device.platform)
    otc, ddp = engine_build.engine_overrides(plan, settings["override_ddp_config"])
    engine_build.enter_mindspeed(plan)
    params_dtype = torch_dtype(dtype)
    bridge = AutoBridge.from_config(hf_config, dtype=params_dtype)
    bridge.set_extra_args(**otc)
    bridge.config.bf16, bridge.config.fp16 = dtype == "bf16", False
    engine_build.adapt_bridge(bridge, plan)
    module = bridge.get_model(
        wrap_with_ddp=True, fp16=False, bf16=dtype == "bf16", post_model_creation_callbacks=[],
        ddp_config={"use_distributed_optimizer": distributed, **ddp},
    )  # fmt: skip
    module = module if isinstance(module, list) else [module]
    engine_build.adapt_module(bridge, module)
    bridge.load_weights(module, str(checkpoint))
    config = module[0].config
    optimizer_config = OptimizerConfig(
        **OPTIMIZER, clip_grad=0.0 if dtype == "fp64" else CLIP_GRAD, bf16=dtype == "bf16", params_dtype=params_dtype,
        use_distributed_optimizer=distributed,
    )  # fmt: skip
    optimizer = get_megatron_optimizer(optimizer_config, module)
    for group in optimizer.param_groups:
        # megatron's param groups carry wd_mult (0 for biases and norm weights), which only its parameter scheduler
        # applies; verl's engine runs one, the job has none: apply it as the scheduler's first step does
        group["weight_decay"] = OPTIMIZER["weight_decay"] * group.get("wd_mult", 1.0)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return Built(module, optimizer, plan, _gpt(module[0]), dtype, clip_here=dtype == "fp64")


def as_verl_loads_it(hf_config: Any) -> Any:
    """The HF config with the edits verl 0.9.1 makes before its engine builds: HFModelConfig zeroes the MTP layer
    counts when MTP is off (verl/workers/config/model.py), make_megatron_module puts ``rope_theta`` on the root
    where transformers 5 keeps it in ``rope_parameters`` (verl/utils/megatron_utils.py, get_hf_rope_theta)."""
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        if hasattr(hf_config, key):
            setattr(hf_config, key, 0)
    if getattr(hf_config, "rope_theta", None) is None:
        rope = getattr(hf_config, "rope_parameters", None)
        if isinstance(rope, dict) and "rope_theta" in rope:
            hf_config.rope_theta = rope["rope_theta"]
    return hf_config


def _gpt(chunk: Any) -> Any:
    from verl_npu.parity.probes import unwrap

    return unwrap(chunk)


# --- running it -----------------------------------------------------------------------------------------------------
def _micro_batches(tokens: Any, count: int) -> list[Any]:
    return list(tokens.chunk(count, dim=0))


def token_log_probs(logits: Any, tokens: Any) -> Any:
    """log p(token t | tokens < t) for t >= 1, from [b, s, V] logits (as verl's log-probs: fp32 or wider)."""
    import torch

    wide = logits if logits.dtype == torch.float64 else logits.float()
    return torch.log_softmax(wide[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _forward_backward(built: Built, batches: Sequence[Any], loss: Callable[[Any, Any, int], Any], forward_only: bool):
    """megatron's schedule over the micro-batches, as verl's engine runs it; per micro-batch what ``loss`` returned."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seen: list[Any] = []
    data = iter(enumerate(batches))

    def forward_step(iterator, model):
        index, tokens = next(iterator)
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        logits = model(tokens, positions, None)

        def loss_func(output):
            value, record = loss(output, tokens, index)
            seen.append(record)
            return value, {"loss": value.detach()}

        return logits, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=built.module, num_microbatches=len(batches),
        seq_length=batches[0].shape[1], micro_batch_size=batches[0].shape[0], forward_only=forward_only,
    )  # fmt: skip
    return seen


def evaluate(
    built: Built, model: ParityModel, device: Device, probes: Any = None, recorder: Any = None, source: Any = None
) -> dict[str, Any]:
    """Log-probs of the evaluation batch; with ``probes``, the checksums and every DSA layer's top-k too; with
    ``recorder``, the block-boundary tensors (parity/replay.py) and, given a ``source``, the replayed blocks."""
    import torch

    from verl_npu.engine import index_share
    from verl_npu.parity.probes import topk_record

    tokens = torch.from_numpy(evaluation_tokens(model)).to(device.torch_device)
    batches = _micro_batches(tokens, model.micro_batches)
    topk: dict[str, Any] = {}

    def loss(logits, micro_tokens, index):
        if probes is not None:
            with probes.recording(index):
                probes.logits(logits)
        return logits.float().sum() * 0.0, token_log_probs(logits, micro_tokens)

    for chunk in built.module:
        chunk.eval()
    with torch.no_grad():
        if probes is None:
            records = _forward_backward(built, batches, loss, forward_only=True)
        else:
            records = []
            for index, micro in enumerate(batches):  # one forward per micro-batch, each inside its recording
                natural = recorder.recording(index) if recorder is not None else contextlib.nullcontext()

                def micro_loss(logits, micro_tokens, _position, index=index):  # the schedule counts from 0 each call
                    return loss(logits, micro_tokens, index)

                with probes.recording(index), natural, index_share.record_topk() as trace:
                    records += _forward_backward(built, [micro], micro_loss, True)
                for layer_number, (kind, indices) in sorted(trace.items()):
                    topk[f"mb{index}/layers.{layer_number - 1}"] = topk_record(kind, indices)
            replayed = _replay(built, batches, recorder, source) if source is not None else None
    for chunk in built.module:
        chunk.train()
    result: dict[str, Any] = {"logprobs": [row for r in records for row in r.double().cpu().tolist()]}
    if probes is not None:
        result |= {"checksums": list(probes.records), "topk": topk, "indexer_qk": probes.indexer_qk}
    if recorder is not None:
        result["replay"] = {"natural": dict(recorder.natural), "replayed": replayed}
    return result


def _log_probs_only(logits: Any, tokens: Any, _index: int) -> tuple[Any, Any]:
    return logits.float().sum() * 0.0, token_log_probs(logits, tokens)


def _replay(built: Built, batches: Sequence[Any], recorder: Any, source: Any) -> dict[str, Any]:
    """Each micro-batch again, every block fed the source's input (parity/replay.py): what each block adds, the
    log-probs from the source's last hidden state, every DSA layer's top-k."""
    from verl_npu.engine import index_share
    from verl_npu.parity.probes import topk_record

    logprobs, topk = [], {}
    for index, micro in enumerate(batches):
        with recorder.replaying(index, source.tensors), index_share.record_topk() as trace:
            rows = _forward_backward(built, [micro], _log_probs_only, True)
        logprobs.append([row for r in rows for row in r.double().cpu().tolist()])
        for layer_number, (kind, indices) in sorted(trace.items()):
            topk[f"mb{index}/layers.{layer_number - 1}"] = topk_record(kind, indices)
    return {"source": source.identity, "outputs": dict(recorder.replayed), "logprobs": logprobs, "topk": topk}


def train(built: Built, model: ParityModel, device: Device, steps: int) -> dict[str, Any]:
    """``steps`` policy-gradient steps; between two steps the offload manager moves everything to the host and back."""
    import torch

    from verl_npu.engine.offload import OffloadManager
    from verl_npu.parity.gradients import update_check

    manager = OffloadManager(built.module, built.optimizer, device=device.torch_device)
    losses, grad_norms = [], []
    first: dict[str, Any] = {}  # step 0's update against AdamW's on the host (parity/gradients.py)
    for step in range(steps):
        if step:
            _offload_cycle(manager)
        tokens = torch.from_numpy(training_tokens(model, step)).to(device.torch_device)
        weights = torch.from_numpy(advantages(model, step)).to(device.torch_device)[:, 1:]
        batches = _micro_batches(tokens, model.micro_batches)
        weight_batches = _micro_batches(weights, model.micro_batches)

        def loss(logits, micro_tokens, index, weights=weight_batches):
            logp = token_log_probs(logits, micro_tokens)
            value = -(logp * weights[index].to(logp.dtype)).mean()
            return value, value.detach()

        for chunk in built.module:
            chunk.zero_grad_buffer()
        built.optimizer.zero_grad()
        step_losses = _forward_backward(built, batches, loss, forward_only=False)
        if step == 0 and built.dtype != "bf16":  # bf16 weights round away an update of lr's size: fp32, fp64 only
            before = {name: p.detach().to("cpu", torch.float64, copy=True) for name, p in _named(built)}
            grads = {name: g.detach().to("cpu", torch.float64, copy=True) for name, g in _named(built, "main_grad")
                     if g is not None}  # fmt: skip
        grad_norm = _clip(built.module, CLIP_GRAD) if built.clip_here else None
        ok, megatron_norm, _ = built.optimizer.step()
        if step == 0 and built.dtype != "bf16":
            after = {name: p.detach().to("cpu", torch.float64, copy=True) for name, p in _named(built)}
            first["update"] = update_check(before, grads, after, OPTIMIZER, CLIP_GRAD)
        grad_norm = megatron_norm if grad_norm is None else grad_norm
        if not ok:
            raise RuntimeError(f"parity run: the optimizer skipped step {step} (a non-finite gradient)")
        losses.append(float(torch.stack(step_losses).double().mean()))
        grad_norms.append(float(grad_norm))
    manager.close() if hasattr(manager, "close") else None
    return {"losses": losses, "grad_norms": grad_norms, **first}


def _offload_cycle(manager: Any) -> None:
    manager.offload(["params", "grads", "optimizer"])
    manager.onload(["params", "grads", "optimizer"])


def gradient_probe(built: Built, model: ParityModel, device: Device, recorder: Any, source: Any) -> dict[str, Any]:
    """The policy-gradient loss's gradient on the evaluation batch, per parameter group (sketches), with every block
    fed the source's input (straight through: the gradient still flows from each block to the one before). Each
    block's gradient is then its own computation at the source's activations, with the source's top-k and expert
    choices: no rounding difference upstream flips a selection, which makes a whole step's gradient differ by
    percents between two correct platforms. Without a source, at the run's own activations. Not applied."""
    import torch

    from verl_npu.parity.gradients import sketches

    tokens = torch.from_numpy(evaluation_tokens(model)).to(device.torch_device)
    weights = torch.from_numpy(advantages(model, 0)).to(device.torch_device)[:, 1:]
    batches, weight_batches = _micro_batches(tokens, model.micro_batches), _micro_batches(weights, model.micro_batches)
    for chunk in built.module:
        chunk.zero_grad_buffer()
    built.optimizer.zero_grad()
    for index, micro in enumerate(batches):

        def loss(logits, micro_tokens, _index, w=weight_batches[index]):
            logp = token_log_probs(logits, micro_tokens)
            value = -(logp * w.to(logp.dtype)).mean()
            return value, value.detach()

        scope = recorder.replaying(index, source.tensors, straight_through=True) if source is not None \
            else contextlib.nullcontext()  # fmt: skip
        with scope:
            _forward_backward(built, [micro], loss, forward_only=False)
    out = sketches(_named(built, "main_grad"))
    for chunk in built.module:
        chunk.zero_grad_buffer()
    built.optimizer.zero_grad()
    return out


def _named(built: Built, attribute: str | None = None) -> list[tuple[str, Any]]:
    """(name, parameter) of the model, or (name, the parameter's ``attribute``) where it has one."""
    out = []
    for chunk in built.module:
        for name, p in _gpt(chunk).named_parameters():
            out.append((name, p if attribute is None else getattr(p, attribute, None)))
    return out


def _clip(module: list[Any], max_norm: float) -> float:
    """Megatron's clip_grad_by_total_norm_fp32 in the gradients' own dtype: the global L2 norm, then a scale of
    max_norm / (norm + 1e-6) when that is below 1; returns the norm (for the fp64 run, see Built.clip_here)."""
    import torch

    grads = [p.main_grad for chunk in module for p in chunk.parameters() if getattr(p, "main_grad", None) is not None]
    norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
    coefficient = max_norm / (norm + 1.0e-6)
    if coefficient < 1.0:
        for g in grads:
            g.mul_(coefficient)
    return norm


def run_model(
    model: ParityModel, device: Device, dtype: str, steps: int, path: str, source: Any = None
) -> dict[str, Any]:
    """One model's numbers (module docstring), from a fresh build; ``source``: the model's replay source."""
    import torch
    from megatron.core import tensor_parallel

    from verl_npu.parity.probes import Probes
    from verl_npu.parity.replay import Recorder

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    with tempfile.TemporaryDirectory(prefix=f"verl-npu-parity-{model.name}-") as directory:
        checkpoint = write_checkpoint(model, directory)
        built = build(model, checkpoint, device, dtype, path)
    probes = Probes(built.gpt)
    recorder = Recorder(built.gpt) if model.replay else None
    evaluation = evaluate(built, model, device, probes, recorder, source if model.replay else None)
    gradient_probes = {}
    if model.replay:  # at the run's own activations (what a run replayed from this one compares with) and the source's
        gradient_probes["gradients_natural"] = gradient_probe(built, model, device, recorder, None)
        gradient_probes["gradients"] = (
            gradient_probe(built, model, device, recorder, source)
            if source is not None
            else gradient_probes["gradients_natural"]
        )
    training = train(built, model, device, steps) | gradient_probes
    after = evaluate(built, model, device)
    return {
        "eval": evaluation,
        "train": training,
        "after_training": after,
        "build": {"features": list(built.plan.features), "platform": built.plan.platform},
    }


def run(options: RunOptions) -> dict[str, Any]:
    """Every requested model's numbers on this machine, as one JSON-ready run."""
    import warnings

    if options.path == "portable":
        os.environ["VERL_NPU_OPS_BACKEND"] = "portable"  # verl-npu's PyTorch operators only (verl_npu.ops.dispatch)
    from verl_npu.parity.compare import source_of

    sources = dict.fromkeys(options.models)
    if options.replay_from:
        sources |= {m: source_of(options.replay_from, m, options.dtype) for m in options.models if MODELS[m].replay}
    device = start_device()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models = {
            name: run_model(MODELS[name], device, options.dtype, options.steps, options.path, sources[name])
            for name in options.models
        }
    nondeterministic = sorted({str(w.message).split(".")[0][:200] for w in caught if "deterministic" in str(w.message)})
    return {
        "format": FORMAT,
        "kind": RUN_KIND,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device.name,
        "platform": device.platform,
        "dtype": options.dtype,
        "path": options.path,
        "steps": options.steps,
        "replay_from": options.replay_from,
        "versions": versions(),
        "nondeterministic_ops": nondeterministic,  # torch's warnings under use_deterministic_algorithms(warn_only)
        "models": models,
    }


def write(result: dict[str, Any], out: str | Path) -> None:
    from verl_npu import atomic

    atomic.write_text(out, json.dumps(result, indent=1, allow_nan=False) + "\n")
