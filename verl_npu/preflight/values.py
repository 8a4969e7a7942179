"""The launch's numbers, read once: a typed, frozen view of the composed verl config that mesh and memory read.

Every value of the composed config that preflight computes with (world size, parallel sizes, batch sizes, lengths,
switches, dtypes) is parsed here, through :mod:`verl_npu.inputs`, into :class:`LaunchValues`; the engine's build plans,
the device mesh and the memory estimate read that view, never the raw mapping. Reading does not stop at the first bad
value: every value that is missing, of the wrong type or out of range becomes its own FAIL check (``config.value``,
naming the dotted key, the value and what is allowed), so one run shows every problem; the view is then ``None`` and
nothing behind this boundary computes with the launch.

:class:`Reader` is the one mechanism: :func:`read_launch` and the model config's reader
(:meth:`verl_npu.preflight.model_shape.ModelShape.from_dict`) both use it. A section deleted with Hydra's ``~key``
is reported once, by its key, when a value under it is required, and read as its defaults when they are optional
(verl's dataclass defaults: an absent ``override_transformer_config`` is no override).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from verl_npu import inputs
from verl_npu.checks import FAIL, Check
from verl_npu.errors import UserError
from verl_npu.inputs import (
    MAX_BATCH,
    MAX_DEVICES,
    MAX_LAYERS,
    MAX_PARALLEL,
    MAX_TOKENS,
    InputError,
)
from verl_npu.parallelism import Parallelism
from verl_npu.preflight import unknowns

MEGATRON = "megatron"  # the actor strategy preflight's mesh and memory model describe
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
_REQUIRED: Any = object()  # no default: a missing value is an error
UNKNOWN_ALLOWED = (
    "a value known before the launch runs (this one is a command's output or assigned in a block preflight does "
    "not evaluate, so it cannot be range-checked): write it literally, or pass its variable with --env NAME=VALUE"
)


class InputErrors(UserError):
    """Several values from outside that are missing, of the wrong type or out of range, all at once."""

    def __init__(self, errors: Sequence[UserError]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(str(e) for e in self.errors))


class Reader:
    """Reads values out of nested mappings through verl_npu.inputs and keeps every error instead of raising the first.

    Keys are dotted paths from ``root``. ``default``: what an absent or null value (or one under an absent section)
    reads as; without it, the value is required. Each reader returns None for a value it could not read, so callers
    build their view only when :attr:`errors` is empty.
    """

    def __init__(self, root: Any, *, source: str | None = None) -> None:
        self.root, self.source = root, source
        self._errors: dict[str, UserError] = {}  # by message: a value read twice is reported once
        self._reported: set[str] = set()

    @property
    def errors(self) -> list[UserError]:
        return list(self._errors.values())

    def _error(self, exc: UserError) -> None:
        self._errors.setdefault(str(exc), exc)

    # --- walking ---------------------------------------------------------------------------------
    def _lookup(self, path: str, required: bool) -> tuple[Any, bool]:
        """(the value at ``path`` or None, whether the sections above it are readable).

        A section above it that is not a mapping is an error; one that is absent only when the value is required.
        """
        node, parts = self.root, path.split(".")
        for depth in range(len(parts)):
            if not isinstance(node, Mapping):
                section = ".".join(parts[:depth]) or "<config>"
                if node is not None or required:
                    self._section_error(section, node)
                return None, False
            node = node.get(parts[depth])
        return node, True

    def _section_error(self, section: str, value: Any) -> None:
        if any(section == s or section.startswith(s + ".") for s in self._reported):
            return  # said once, for the outermost broken section
        self._reported.add(section)
        allowed = "a section of keys (it is missing: deleted with ~?)" if value is None else "a section of keys"
        self._error(InputError(section, value, allowed, source=self.source))

    def raw(self, path: str) -> Any:
        """The value at ``path`` as it is (None when it or a section above it is absent), without reporting anything."""
        node = self.root
        for part in path.split("."):
            if not isinstance(node, Mapping):
                return None
            node = node.get(part)
        return node

    def present(self, path: str) -> bool:
        """Whether ``path`` holds a value (not None), without reporting anything."""
        return self.raw(path) is not None

    # --- values ------------------------------------------------------------------------------------
    def value(self, path: str, parse: Callable[[str, Any], Any], default: Any = _REQUIRED) -> Any:
        raw, readable = self._lookup(path, default is _REQUIRED)
        if not readable:
            return None if default is _REQUIRED else default
        if raw is None:
            if default is not _REQUIRED:
                return default
            self._error(InputError(path, None, "a value (it is missing)", source=self.source))
            return None
        if unknowns.contains(raw):  # never range-checked as if it were known (verl_npu.preflight.unknowns)
            self._error(InputError(path, raw, UNKNOWN_ALLOWED, source=self.source))
            return None
        try:
            return parse(path, raw)
        except UserError as exc:
            self._error(exc)
            return None

    def section(self, path: str, *, default: Any = _REQUIRED) -> Mapping[str, Any] | None:
        """The mapping at ``path``; ``default`` (e.g. ``{}``) when it is absent and optional."""
        if self.present(path) or default is _REQUIRED:
            raw, readable = self._lookup(path, True)
            if not readable:
                return None
            if not isinstance(raw, Mapping):
                self._section_error(path, raw)
                return None
            return raw
        return default

    def integer(self, path: str, minimum: int, maximum: int, default: Any = _REQUIRED) -> int | None:
        src = self.source
        return self.value(
            path, lambda k, v: inputs.integer(k, v, minimum=minimum, maximum=maximum, source=src), default
        )

    def number(self, path: str, minimum: float, maximum: float, default: Any = _REQUIRED) -> float | None:
        src = self.source
        return self.value(path, lambda k, v: inputs.number(k, v, minimum=minimum, maximum=maximum, source=src), default)

    def boolean(self, path: str, default: Any = _REQUIRED) -> bool | None:
        return self.value(path, lambda k, v: inputs.boolean(k, v, source=self.source), default)

    def choice(self, path: str, choices: Collection[str], default: Any = _REQUIRED) -> str | None:
        return self.value(path, lambda k, v: inputs.choice(k, v, choices, source=self.source), default)

    def text(self, path: str, default: Any = _REQUIRED, max_length: int = 4096) -> str | None:
        return self.value(path, lambda k, v: inputs.text(k, v, max_length=max_length, source=self.source), default)

    def dtype(self, path: str, default: str) -> str | None:
        """A dtype's canonical name (verl_npu.dtypes, the build plan's table); absent: ``default``."""
        from verl_npu.dtypes import parse

        return self.value(path, lambda k, v: parse(v, what=k), default=parse(default))

    def text_list(self, path: str, default: Any = _REQUIRED, max_items: int = MAX_LAYERS) -> tuple[str, ...] | None:
        def parse(key: str, value: Any) -> tuple[str, ...]:
            allowed = f"a list of at most {max_items} strings"
            if isinstance(value, str | bytes) or not isinstance(value, Sequence) or len(value) > max_items:
                raise InputError(key, value, allowed, source=self.source)
            if not all(isinstance(item, str) for item in value):
                raise InputError(key, value, allowed, source=self.source)
            return tuple(value)

        return self.value(path, parse, default)

    def rule(self, holds: bool, key: str, value: Any, allowed: str) -> None:
        """A rule between values (e.g. nnodes x devices within bounds); reported like a value out of range."""
        if not holds:
            self._error(InputError(key, value, allowed, source=self.source))

    # --- the outcome -------------------------------------------------------------------------------
    def checks(self, name: str = "config.value") -> list[Check]:
        """One FAIL check per error, in reading order."""
        return [Check(name, FAIL, str(exc)) for exc in self.errors]

    def raise_errors(self) -> None:
        if self.errors:
            raise InputErrors(self.errors)


# --- the view ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MegatronRole:
    """One Megatron role's engine settings (``<role>.megatron``), as the mesh and the memory estimate read them."""

    role: str  # actor, ref or critic
    # its process groups over the launch's devices and its pipeline's layer split (the one record: the mesh check,
    # the memory and start-up estimates read it)
    parallelism: Parallelism
    layers_per_vpp_chunk: int | None  # override_transformer_config.num_layers_per_virtual_pipeline_stage
    use_remove_padding: bool
    param_offload: bool
    optimizer_offload: bool
    use_distributed_optimizer: bool
    params_dtype: str  # canonical (verl_npu.dtypes)
    grad_reduce_in_fp32: bool | None  # override_ddp_config's; None: the build plan's (or megatron's) default
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None


@dataclasses.dataclass(frozen=True)
class RolloutValues:
    """The rollout's settings as vLLM receives them: verl 0.9.1's vLLM server passes its own arguments, then
    ``engine_kwargs.vllm`` over them (a key there wins), and ``compilation_config`` from ``engine_kwargs.vllm``
    with ``cudagraph_mode`` defaulting to FULL_AND_PIECEWISE (verl/workers/rollout/vllm_rollout/
    vllm_async_server.py, ``launch_server``). Each ``*_key`` names the key the value came from, for messages."""

    name: str | None
    tp: int
    dp: int
    pp: int
    ep: int
    n: int  # responses per prompt
    gpu_memory_utilization: float
    gpu_memory_utilization_key: str = "actor_rollout_ref.rollout.gpu_memory_utilization"
    max_model_len: int | None = None  # None: verl passes the model's max_position_embeddings
    max_model_len_key: str = "actor_rollout_ref.rollout.max_model_len"
    dtype: str = "bf16"  # the rollout's weights and KV cache (canonical, verl_npu.dtypes)
    enforce_eager: bool = False
    cudagraph_mode: str = "FULL_AND_PIECEWISE"  # vLLM's CUDAGraphMode name, upper case
    enable_sleep_mode: bool = True
    free_cache_engine: bool = True
    block_size: int | None = None  # engine_kwargs.vllm.block_size (None: the platform's)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    mtp_rollout: bool = False  # actor_rollout_ref.rollout.mtp: the rollout drafts with the model's MTP layer
    # vllm-ascend's additional_config entries that win over their environment variables (None: not given)
    enable_fused_mc2: int | None = None
    weight_nz_mode: int | None = None

    @property
    def graphs(self) -> bool:
        """Whether vLLM captures device graphs: enforce_eager turns every cudagraph_mode into NONE."""
        return not self.enforce_eager and self.cudagraph_mode != "NONE"


@dataclasses.dataclass(frozen=True)
class LaunchValues:
    """What preflight computes with, from one composed verl config; every field typed and in range."""

    nnodes: int
    n_gpus_per_node: int
    train_batch_size: int
    max_prompt_length: int
    max_response_length: int
    strategy: str  # the actor's: megatron (modelled here), fsdp, fsdp2, ...
    ppo_mini_batch_size: int
    ppo_micro_batch_size_per_gpu: int | None
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: int | None
    log_prob_max_token_len_per_gpu: int | None
    hybrid_engine: bool
    use_precision_aware_optimizer: bool
    main_params_dtype: str
    rollout: RolloutValues
    actor: MegatronRole | None  # None: the actor is not a Megatron engine (FSDP)
    ref: MegatronRole | None = None  # a Megatron reference model
    critic: MegatronRole | None = None  # an enabled Megatron critic

    @property
    def world(self) -> int:
        return self.nnodes * self.n_gpus_per_node

    @property
    def max_sequence(self) -> int:
        return self.max_prompt_length + self.max_response_length

    @property
    def megatron_roles(self) -> dict[str, MegatronRole]:
        roles = {"actor": self.actor, "ref": self.ref, "critic": self.critic}
        return {name: role for name, role in roles.items() if role is not None}


ARR = "actor_rollout_ref"
ACTOR, ROLLOUT = f"{ARR}.actor", f"{ARR}.rollout"
# the config section of each Megatron role's engine settings, and of its optimizer's
ROLE_SECTIONS = {"actor": ACTOR, "ref": f"{ARR}.ref", "critic": "critic"}


def read_launch(config: Any) -> tuple[LaunchValues | None, list[Check]]:
    """The typed view of a resolved verl config, and one FAIL check per bad value (the view is None if any)."""
    r = Reader(config)
    nnodes = r.integer("trainer.nnodes", 1, MAX_DEVICES)
    devices = r.integer("trainer.n_gpus_per_node", 1, MAX_DEVICES)
    if nnodes and devices:
        r.rule(nnodes * devices <= MAX_DEVICES, "trainer.nnodes x trainer.n_gpus_per_node", nnodes * devices,
               f"at most {MAX_DEVICES} devices in one job")  # fmt: skip
    prompt = r.integer("data.max_prompt_length", 1, MAX_TOKENS)
    response = r.integer("data.max_response_length", 1, MAX_TOKENS)
    if prompt and response:
        r.rule(prompt + response <= MAX_TOKENS, "data.max_prompt_length + data.max_response_length", prompt + response,
               f"at most {MAX_TOKENS} tokens in one sequence")  # fmt: skip
    strategy = r.text(f"{ACTOR}.strategy", max_length=64)
    dynamic = r.boolean(f"{ACTOR}.use_dynamic_bsz", default=False)
    fields: dict[str, Any] = dict(
        nnodes=nnodes,
        n_gpus_per_node=devices,
        train_batch_size=r.integer("data.train_batch_size", 1, MAX_BATCH),
        max_prompt_length=prompt,
        max_response_length=response,
        strategy=strategy,
        ppo_mini_batch_size=r.integer(f"{ACTOR}.ppo_mini_batch_size", 1, MAX_BATCH),
        ppo_micro_batch_size_per_gpu=r.integer(f"{ACTOR}.ppo_micro_batch_size_per_gpu", 1, MAX_BATCH, default=None),
        use_dynamic_bsz=dynamic,
        # the token budget packs whole sequences: required with dynamic batch size
        ppo_max_token_len_per_gpu=r.integer(
            f"{ACTOR}.ppo_max_token_len_per_gpu", 1, MAX_TOKENS, **({} if dynamic else {"default": None})
        ),
        log_prob_max_token_len_per_gpu=r.integer(f"{ACTOR}.log_prob_max_token_len_per_gpu", 1, MAX_TOKENS, None),
        hybrid_engine=r.boolean(f"{ARR}.hybrid_engine", default=True),
        use_precision_aware_optimizer=r.boolean(f"{ACTOR}.optim.use_precision_aware_optimizer", default=False),
        main_params_dtype=r.dtype(f"{ACTOR}.optim.main_params_dtype", "fp32"),
        rollout=_rollout(r),
        actor=None,
    )
    if strategy == MEGATRON:
        world = nnodes * devices if nnodes and devices else None
        fields["actor"] = _megatron_role(r, "actor", world)
        if r.present(f"{ARR}.ref.{MEGATRON}"):
            fields["ref"] = _megatron_role(r, "ref", world)
        if r.boolean("critic.enable", default=False) and r.present(f"critic.{MEGATRON}"):
            fields["critic"] = _megatron_role(r, "critic", world)
    if r.errors:
        return None, r.checks()
    return LaunchValues(**fields), []


def read_model_path(config: Any) -> tuple[str | None, list[Check]]:
    """``actor_rollout_ref.model.path`` (None when unset): the model whose config the worker resolves."""
    r = Reader(config)
    key = f"{ARR}.model.path"
    if unknowns.contains(raw := r.raw(key)):
        return raw, []  # only the running launch knows it: --model-config (or the config beside the script) decides
    path = r.text(key, default=None)
    return path, r.checks()


CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")  # vLLM's CUDAGraphMode
VERL_CUDAGRAPH_MODE = "FULL_AND_PIECEWISE"  # what verl 0.9.1's vLLM server sets when compilation_config has none
ENGINE = f"{ROLLOUT}.engine_kwargs.vllm"


def _rollout(r: Reader) -> RolloutValues | None:
    engine = r.section(ENGINE, default={})

    def engine_or(key: str, read: Callable[..., Any], *args: Any, default: Any) -> tuple[Any, str]:
        """engine_kwargs.vllm.<key> when it is there (verl passes it over its own argument), else rollout.<key>."""
        if engine is not None and engine.get(key) is not None:
            return read(f"{ENGINE}.{key}", *args), f"{ENGINE}.{key}"
        return read(f"{ROLLOUT}.{key}", *args, default=default), f"{ROLLOUT}.{key}"

    utilization, utilization_key = engine_or("gpu_memory_utilization", r.number, 0.0, 1.0, default=0.0)
    max_len, max_len_key = engine_or("max_model_len", r.integer, 1, MAX_TOKENS, default=None)
    eager, _ = engine_or("enforce_eager", r.boolean, default=False)
    compilation = r.value(f"{ENGINE}.compilation_config", _compilation_config, default={})
    mode = compilation.get("cudagraph_mode") if compilation is not None else None
    mtp = r.section(f"{ROLLOUT}.mtp", default={}) or {}
    mtp_on = bool(mtp.get("enable") is True and mtp.get("enable_rollout") is True)
    additional = r.section(f"{ENGINE}.additional_config", default={})
    values = dict(
        name=r.text(f"{ROLLOUT}.name", default=None, max_length=64),
        tp=r.integer(f"{ROLLOUT}.tensor_model_parallel_size", 1, MAX_PARALLEL, default=1),
        dp=r.integer(f"{ROLLOUT}.data_parallel_size", 1, MAX_PARALLEL, default=1),
        pp=r.integer(f"{ROLLOUT}.pipeline_model_parallel_size", 1, MAX_PARALLEL, default=1),
        ep=r.integer(f"{ROLLOUT}.expert_parallel_size", 1, MAX_PARALLEL, default=1),
        n=r.integer(f"{ROLLOUT}.n", 1, MAX_BATCH, default=1),
        gpu_memory_utilization=utilization,
        gpu_memory_utilization_key=utilization_key,
        max_model_len=max_len,
        max_model_len_key=max_len_key,
        dtype=r.dtype(f"{ROLLOUT}.dtype", "bf16"),
        enforce_eager=eager,
        cudagraph_mode=mode or VERL_CUDAGRAPH_MODE,
        enable_sleep_mode=r.boolean(f"{ROLLOUT}.enable_sleep_mode", default=True),
        free_cache_engine=r.boolean(f"{ROLLOUT}.free_cache_engine", default=True),
        block_size=r.integer(f"{ENGINE}.block_size", 1, MAX_TOKENS, default=None),
        enable_prefix_caching=engine_or("enable_prefix_caching", r.boolean, default=True)[0],
        enable_chunked_prefill=engine_or("enable_chunked_prefill", r.boolean, default=True)[0],
        mtp_rollout=mtp_on,
        enable_fused_mc2=r.integer(f"{ENGINE}.additional_config.enable_fused_mc2", 0, 2, default=None),
        weight_nz_mode=r.integer(f"{ENGINE}.additional_config.weight_nz_mode", 0, 2, default=None),
    )
    optional = ("name", "max_model_len", "block_size", "enable_fused_mc2", "weight_nz_mode")
    if compilation is None or additional is None or engine is None:
        return None
    return None if any(v is None for k, v in values.items() if k not in optional) else RolloutValues(**values)


def _compilation_config(key: str, value: Any) -> Mapping[str, Any]:
    """vLLM's compilation_config as verl passes it (a mapping, or JSON text it decodes): its cudagraph_mode
    upper-cased as vLLM parses it (vllm/config/compilation.py), one of :data:`CUDAGRAPH_MODES`."""
    import json

    allowed = f"a mapping (or its JSON text) whose cudagraph_mode is one of {', '.join(CUDAGRAPH_MODES)}"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise InputError(key, value, allowed) from None
    if not isinstance(value, Mapping):
        raise InputError(key, value, allowed)
    mode = value.get("cudagraph_mode")
    if mode is None:
        return {}
    if not isinstance(mode, str) or mode.upper() not in CUDAGRAPH_MODES:
        raise InputError(f"{key}.cudagraph_mode", mode, f"one of {', '.join(CUDAGRAPH_MODES)}")
    return {"cudagraph_mode": mode.upper()}


def _megatron_role(r: Reader, role: str, world: int | None) -> MegatronRole | None:
    """``world``: the launch's devices (None: not readable, and the view is None)."""
    section = ROLE_SECTIONS[role]
    mcore = f"{section}.{MEGATRON}"
    if r.section(mcore) is None:
        return None
    otc, ddp = f"{mcore}.override_transformer_config", f"{mcore}.override_ddp_config"
    r.section(otc, default={})  # a section, when there is one
    r.section(ddp, default={})
    parallelism = _parallelism(r, mcore, otc, world)
    r.text_list(f"{otc}.recompute_modules", default=None, max_items=64)  # the build plan reads it
    # read first, checked for None below: MegatronRole's types hold only after that check
    values: dict[str, Any] = dict(
        role=role,
        layers_per_vpp_chunk=r.integer(f"{otc}.num_layers_per_virtual_pipeline_stage", 1, MAX_LAYERS, default=None),
        use_remove_padding=r.boolean(f"{mcore}.use_remove_padding", default=True),
        param_offload=r.boolean(f"{mcore}.param_offload", default=False),
        optimizer_offload=r.boolean(f"{mcore}.optimizer_offload", default=False),
        use_distributed_optimizer=r.boolean(f"{mcore}.use_distributed_optimizer", default=True),
        params_dtype=r.dtype(f"{mcore}.dtype", "bf16"),
        grad_reduce_in_fp32=r.boolean(f"{ddp}.grad_reduce_in_fp32", default=None),
        recompute_granularity=r.choice(f"{otc}.recompute_granularity", RECOMPUTE_GRANULARITIES, default=None),
        recompute_method=r.choice(f"{otc}.recompute_method", RECOMPUTE_METHODS, default=None),
        recompute_num_layers=r.integer(f"{otc}.recompute_num_layers", 1, MAX_LAYERS, default=None),
    )
    optional = ("layers_per_vpp_chunk", "grad_reduce_in_fp32", "recompute_granularity", "recompute_method",
                "recompute_num_layers")  # fmt: skip
    if parallelism is None or any(v is None for k, v in values.items() if k not in optional):
        return None
    return MegatronRole(**values, parallelism=parallelism)


def _parallelism(r: Reader, mcore: str, otc: str, world: int | None) -> Parallelism | None:
    """The role's sizes over the launch's ``world`` devices (None: a size, or the world, is not readable)."""
    tp = r.integer(f"{mcore}.tensor_model_parallel_size", 1, MAX_PARALLEL, default=1)
    etp = r.integer(f"{mcore}.expert_tensor_parallel_size", 1, MAX_PARALLEL, default=None)
    pp = r.integer(f"{mcore}.pipeline_model_parallel_size", 1, MAX_PARALLEL, default=1)
    cp = r.integer(f"{mcore}.context_parallel_size", 1, MAX_PARALLEL, default=1)
    ep = r.integer(f"{mcore}.expert_model_parallel_size", 1, MAX_PARALLEL, default=1)
    sequence_parallel = r.boolean(f"{mcore}.sequence_parallel", default=False)
    vpp = r.integer(f"{mcore}.virtual_pipeline_model_parallel_size", 1, MAX_LAYERS, default=None)
    first = r.integer(f"{otc}.num_layers_in_first_pipeline_stage", 1, MAX_LAYERS, default=None)
    last = r.integer(f"{otc}.num_layers_in_last_pipeline_stage", 1, MAX_LAYERS, default=None)
    if world is None or tp is None or pp is None or cp is None or ep is None or sequence_parallel is None:
        return None
    return Parallelism(
        world=world,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        etp=etp if etp is not None else tp,  # null: TP, as megatron-core defaults it
        sequence_parallel=sequence_parallel,
        vpp=vpp,
        first_stage_layers=first,
        last_stage_layers=last,
    )
