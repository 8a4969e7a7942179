"""IndexShare: GLM-5.2's shared DSA layers attend over the top-k of the most recent full layer.

megatron-core 0.18 computes a DSA top-k in every layer. GLM-5.2 marks each layer "full" or
"shared" (``indexer_types``, IndexShare, arXiv 2603.12201): a shared layer ships no indexer weights
and attends over the keys the most recent full layer selected for the same tokens. A shared layer
that picks its own top-k degrades the model (perplexity 3.21 against 2.72 at 4k tokens, see
docs/upstream_facts.md), so the reuse must be exact.

How the engine does it:

* Layer specs (:func:`apply_to_block_spec`): a full layer's core attention is
  :class:`IndexSourceDSAttention`, a shared layer's :class:`IndexSharedDSAttention`, whose indexer is
  :class:`NoIndexer` (no parameters: no DDP, optimizer or offload bytes). The spec also carries what
  the reference implementation (transformers' GlmMoeDsa, which the rollout's bf16 path follows)
  does differently from megatron: the indexer key norm's eps and no Hadamard rotation of q/k.
* The carry: one :class:`TopKCarry` per forward pass of a decoder block (runtime patch
  ``dsa-index-share-forward``). A full layer publishes the top-k its sparse attention ran with (the
  sparse attention function itself reports it, whichever backend or MindSpeed path runs it); a
  shared layer reads the latest. Nothing outlives the forward pass, so no top-k reaches another
  micro-batch or another forward.
* Activation recompute (``dsa-index-share-recompute``): a checkpointed chunk keeps the carry's
  latest top-k from the moment its forward started and recomputes with it, so a shared layer
  recomputed during backward reads what its forward read.
* Pipeline stages (``dsa-index-share-pipeline``): when the next stage begins with a shared layer,
  the stage sends its forward's latest top-k after the activations, per micro-batch and in schedule
  order, and the next stage's forward starts with what it received.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from verl_npu.models.glm5.config import FULL, SHARED

logger = logging.getLogger(__name__)

# The reference implementation's indexer key norm (transformers GlmMoeDsaIndexer, vLLM): LayerNorm eps 1e-6;
# megatron-core 0.18 builds it with the model's layernorm_epsilon (1e-5 for GLM-5).
REFERENCE_K_NORM_EPS = 1e-6


class IndexShareError(RuntimeError):
    """The shared top-k cannot be served (no full layer before, a carry missing, a layout not supported)."""


@dataclasses.dataclass(frozen=True)
class IndexShareSpec:
    """What a DSA layer's spec says about its indexer (passed to the attention class by its ModuleSpec)."""

    kinds: tuple[str, ...]  # every layer of the model, "full" or "shared"
    k_norm_eps: float | None = REFERENCE_K_NORM_EPS  # None: megatron's layernorm_epsilon
    rotate_indexer: bool = False  # megatron's Hadamard rotation of the indexer's q/k (the reference has none)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One pipeline stage's layers [first_layer, first_layer + num_layers) and what it does with the carry."""

    kinds: tuple[str, ...]
    first_layer: int
    num_layers: int

    @property
    def layers(self) -> str:
        return f"{self.first_layer}..{self.first_layer + self.num_layers - 1}"

    @property
    def receives(self) -> bool:
        """It starts on a shared layer: the previous stage's latest top-k comes with its activations."""
        return self.first_layer > 0 and self.kinds[self.first_layer] == SHARED

    @property
    def sends(self) -> bool:
        """The next stage starts on a shared layer: this stage's latest top-k goes with its activations."""
        end = self.first_layer + self.num_layers
        return end < len(self.kinds) and self.kinds[end] == SHARED


def stage_plans(kinds: Sequence[str], layers_per_stage: Sequence[int]) -> list[StagePlan]:
    """The plan of every stage of a pipeline layout (for preflight and the build plan)."""
    if sum(layers_per_stage) != len(kinds):
        raise ValueError(f"stages hold {sum(layers_per_stage)} layers, the model has {len(kinds)}")
    plans, first = [], 0
    for n in layers_per_stage:
        plans.append(StagePlan(tuple(kinds), first, n))
        first += n
    return plans


# --- the carry ---------------------------------------------------------------------------------------


class TopKCarry:
    """The latest top-k of one forward pass (``[b, s, k]`` key indices), published by full layers."""

    __slots__ = ("latest", "source_layer")

    def __init__(self, latest: Any = None, source_layer: int | None = None):
        self.latest = latest
        self.source_layer = source_layer


@dataclasses.dataclass
class _Source:
    """A full layer's attention while it runs."""

    layer_number: int
    rotate: bool  # whether its indexer rotates q/k
    published: bool = False


_CARRY: contextvars.ContextVar[TopKCarry | None] = contextvars.ContextVar("verl_npu_topk_carry", default=None)
_SOURCE: contextvars.ContextVar[_Source | None] = contextvars.ContextVar("verl_npu_topk_source", default=None)
_TRACE: contextvars.ContextVar[dict[int, tuple[str, Any]] | None] = contextvars.ContextVar(
    "verl_npu_topk_trace", default=None
)


@contextlib.contextmanager
def forward_scope(incoming: Any = None, source_layer: int | None = None) -> Iterator[TopKCarry]:
    """A fresh carry for one forward pass (optionally starting with a top-k received from the previous stage)."""
    carry = TopKCarry(incoming, source_layer)
    token = _CARRY.set(carry)
    try:
        yield carry
    finally:
        _CARRY.reset(token)


@contextlib.contextmanager
def _source_scope(layer_number: int, rotate: bool) -> Iterator[_Source]:
    source = _Source(layer_number, rotate)
    token = _SOURCE.set(source)
    try:
        yield source
    finally:
        _SOURCE.reset(token)


def indexer_rotates() -> bool:
    """Whether the DSA indexer running now rotates its q/k (megatron's default outside a full IndexShare layer)."""
    source = _SOURCE.get()
    return True if source is None else source.rotate


def publish(topk_indices: Any) -> None:
    """Called with the top-k a sparse attention runs with: inside a full layer it becomes the carry's latest."""
    source, carry = _SOURCE.get(), _CARRY.get()
    if source is None:
        return
    source.published = True
    _note(reads=False)
    if carry is not None:
        carry.latest, carry.source_layer = topk_indices, source.layer_number
    trace = _TRACE.get()
    if trace is not None:
        trace[source.layer_number] = (FULL, topk_indices.detach().clone())


def carried(layer_number: int) -> Any:
    """The top-k a shared layer attends over: the latest of this forward pass."""
    _note(reads=True)
    carry = _CARRY.get()
    if carry is None or carry.latest is None:
        raise IndexShareError(
            f"DSA layer {layer_number} shares the top-k of an earlier full layer, but this forward pass has none: "
            "the model ran outside a decoder block's forward, or the previous pipeline stage sent no top-k "
            "(verl_npu.engine.index_share)"
        )
    trace = _TRACE.get()
    if trace is not None:
        trace[layer_number] = (SHARED, carry.latest.detach().clone())
    return carry.latest


@contextlib.contextmanager
def record_topk() -> Iterator[dict[int, tuple[str, Any]]]:
    """Every DSA layer's top-k during the block (layer number -> ("full" or "shared", indices)); for tests."""
    trace: dict[int, tuple[str, Any]] = {}
    token = _TRACE.set(trace)
    try:
        yield trace
    finally:
        _TRACE.reset(token)


class _ChunkProbe:
    """Whether a checkpointed chunk's first DSA layer read the carry (a shared layer) or published (a full one)."""

    __slots__ = ("reads_first",)

    def __init__(self):
        self.reads_first: bool | None = None


_PROBES: contextvars.ContextVar[tuple[_ChunkProbe, ...]] = contextvars.ContextVar("verl_npu_topk_probes", default=())


def _note(reads: bool) -> None:
    for probe in _PROBES.get():
        if probe.reads_first is None:
            probe.reads_first = reads


def recompute_safe(function: Callable) -> Callable:
    """Wrap a checkpointed chunk's function: its recomputation sees the carry its forward saw.

    The first call is the forward (it publishes into the forward's carry as usual); every later call
    is a recomputation in backward, which runs with a private carry holding the latest top-k from
    when the forward started, so nothing published since (later layers, other micro-batches) leaks in.
    That top-k is kept until backward only when the chunk reads it, i.e. a shared layer comes before
    any full layer in the chunk; otherwise the recomputation publishes its own first.
    """
    carry = _CARRY.get()
    if carry is None:
        return function
    start = (carry.latest, carry.source_layer)
    calls = 0

    @functools.wraps(function)
    def run(*args, **kwargs):
        nonlocal calls, start
        calls += 1
        if calls == 1:
            probe = _ChunkProbe()
            token = _PROBES.set((*_PROBES.get(), probe))
            try:
                return function(*args, **kwargs)
            finally:
                _PROBES.reset(token)
                if not probe.reads_first:
                    start = (None, None)  # the chunk never reads it: do not hold it until backward
        with forward_scope(*start):
            return function(*args, **kwargs)

    return run


# --- pipeline stages ---------------------------------------------------------------------------------

_STAGE: StagePlan | None = None
_INCOMING: collections.deque = collections.deque()
_OUTGOING: collections.deque = collections.deque()


def register_stage(plan: StagePlan) -> None:
    """This process's stage (one model chunk per process: interleaved pipelines are refused by the build plan)."""
    global _STAGE
    if _STAGE is not None and plan != _STAGE:
        logger.debug("verl-npu IndexShare: stage plan changes from %s to %s", _STAGE, plan)
    _STAGE = plan
    _INCOMING.clear()
    _OUTGOING.clear()


def current_stage() -> StagePlan | None:
    return _STAGE


def received(topk: Any) -> None:
    _INCOMING.append(topk)


def _take(queue: collections.deque, missing: str) -> Any:
    if not queue:
        raise IndexShareError(missing)
    return queue.popleft()


def take_received(plan: StagePlan) -> Any:
    return _take(
        _INCOMING,
        f"this pipeline stage starts on shared DSA layer {plan.first_layer + 1}, but no top-k came from the "
        "previous stage with the activations",
    )


def to_send(topk: Any) -> None:
    _OUTGOING.append(topk)


def take_to_send(plan: StagePlan) -> Any:
    return _take(
        _OUTGOING,
        f"the next pipeline stage starts on shared DSA layer {plan.first_layer + plan.num_layers + 1}, but "
        "this stage's forward produced no top-k to send",
    )


def block_plan(block: Any) -> StagePlan | None:
    """The plan of a decoder block built with IndexShare layers; None for any other block."""
    if "_verl_npu_index_share" not in block.__dict__:
        attentions = [getattr(getattr(layer, "self_attention", None), "core_attention", None) for layer in block.layers]
        shared = [a for a in attentions if isinstance(a, _IndexShareMixin)]
        plan = None
        if shared:
            first = block.layers[0].layer_number - 1
            plan = StagePlan(shared[0].index_share.kinds, first, len(block.layers))
        block.__dict__["_verl_npu_index_share"] = plan
    return block.__dict__["_verl_npu_index_share"]


# --- layer specs and modules ---------------------------------------------------------------------------


def _norm_eps(norm: Any) -> str:
    for name in ("eps", "variance_epsilon", "epsilon"):
        if hasattr(norm, name):
            return name
    raise IndexShareError(f"cannot set the DSA indexer key norm's eps: {type(norm).__name__} has no eps attribute")


class _IndexShareMixin:
    index_share: IndexShareSpec


def _dsa_attention() -> type:
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    return DSAttention


@functools.cache
def classes() -> tuple[type, type, type]:
    """(IndexSourceDSAttention, IndexSharedDSAttention, NoIndexer), built on megatron-core's DSAttention."""
    from megatron.core.transformer.module import MegatronModule

    # megatron-core ships no types: as Any, mypy takes the class as a base (it refuses a variable of type `type`)
    dsa_attention: Any = _dsa_attention()

    class NoIndexer(MegatronModule):
        """A shared layer's indexer: nothing to compute and no parameters (the checkpoint has none)."""

        def __init__(self, config, pg_collection=None, **_):
            super().__init__(config=config)
            self.pg_collection = pg_collection

        def forward(self, *args, **kwargs):
            raise IndexShareError("a shared DSA layer has no indexer: it reuses the most recent full layer's top-k")

    class IndexSourceDSAttention(_IndexShareMixin, dsa_attention):
        """A full layer: megatron's DSAttention (or MindSpeed's fused forward), publishing its top-k."""

        def __init__(self, *args, index_share: IndexShareSpec, **kwargs):
            super().__init__(*args, **kwargs)
            self.index_share = index_share
            if index_share.k_norm_eps is not None:
                norm = self.indexer.k_norm
                setattr(norm, _norm_eps(norm), index_share.k_norm_eps)

        def forward(self, *args, **kwargs):
            with _source_scope(self.layer_number, self.index_share.rotate_indexer) as source:
                output = super().forward(*args, **kwargs)
            if _CARRY.get() is not None and not source.published:
                raise IndexShareError(
                    f"full DSA layer {self.layer_number} ran its sparse attention without reporting its top-k: "
                    "an attention path verl_npu.engine.index_share does not know (see its runtime patches)"
                )
            return output

    class IndexSharedDSAttention(_IndexShareMixin, dsa_attention):
        """A shared layer: sparse attention over the most recent full layer's top-k; no indexer, no indexer loss."""

        def __init__(self, *args, index_share: IndexShareSpec, **kwargs):
            super().__init__(*args, **kwargs)
            self.index_share = index_share

        def forward(
            self, query, key, value, attention_mask, x=None, qr=None, attn_mask_type=None, attention_bias=None,
            packed_seq_params=None,
        ):  # fmt: skip
            topk_indices = carried(self.layer_number)
            if getattr(self.config, "use_fused_sparse_flash_attention", False):
                return _mindspeed_sparse_attention(self, query, key, value, topk_indices, packed_seq_params)
            if packed_seq_params is not None:
                raise IndexShareError("DSA takes no packed (THD) input in megatron-core 0.18")
            from megatron.core.transformer.experimental_attention_variant import dsa

            return dsa.unfused_dsa_fn(query, key, value, topk_indices, self.softmax_scale)

    return IndexSourceDSAttention, IndexSharedDSAttention, NoIndexer


def _mindspeed_sparse_attention(layer, query, key, value, topk_indices, packed_seq_params):
    """A shared layer on MindSpeed's fused path: its sparse-attention operator (P1) over the carried top-k,
    without its indexer (P2) and indexer loss (P3), split as MindSpeed's fused_dsa_attn_forward splits."""
    from mindspeed.args_utils import get_full_args
    from mindspeed.core.transformer.experimental_attention_variant import dsa_npu_fused

    config = layer.config
    rope = config.qk_pos_emb_head_dim
    nope = next(
        (d for d in (config.qk_head_dim, config.kv_lora_rank) if query.size(-1) == key.size(-1) == d + rope), None
    )
    if nope is None:
        raise IndexShareError(f"fused DSA expects query/key dims of qk_head_dim or kv_lora_rank + {rope}")
    query_nope, query_rope = query.split([nope, rope], dim=-1)
    key_nope, key_rope = key.split([nope, rope], dim=-1)
    args = get_full_args()
    if args.context_parallel_size > 1 and args.context_parallel_algo == "kvallgather_cp_algo":
        import torch
        from megatron.core import mpu
        from mindspeed.core.transformer.experimental_attention_variant import dsa_kvallgather_context_parallel as cp

        output, _, _ = cp.fused_npu_sparse_flash_attention_kvallgather(
            query_nope, key_nope, value, topk_indices, query_rope, key_rope, layer.softmax_scale,
            cp_group=mpu.get_context_parallel_group(), cp_stream=torch.npu.Stream(device=torch.npu.current_device()),
            layout="TND" if packed_seq_params is not None else "BSND", packed_seq_params=packed_seq_params,
        )  # fmt: skip
        return output
    output, _, _ = dsa_npu_fused.fused_npu_sparse_flash_attention(
        query_nope, key_nope, value, topk_indices, query_rope, key_rope, layer.softmax_scale,
        packed_seq_params=packed_seq_params,
    )  # fmt: skip
    return output


def _dsa_specs(spec: Any) -> Iterator[tuple[Any, str, Any]]:
    """(owner, field, ModuleSpec) for every DSAttention ModuleSpec in a layer's spec tree."""
    dsa_attention = _dsa_attention()
    submodules = getattr(spec, "submodules", None)
    if submodules is None or not dataclasses.is_dataclass(submodules):
        return
    for field in dataclasses.fields(submodules):
        value = getattr(submodules, field.name)
        module = getattr(value, "module", None)
        if isinstance(module, type) and issubclass(module, dsa_attention):
            yield submodules, field.name, value
        elif hasattr(value, "submodules"):
            yield from _dsa_specs(value)


def apply_to_block_spec(block_spec: Any, share: IndexShareSpec, first_layer: int) -> StagePlan:
    """Give each DSA layer of a decoder block spec its IndexShare attention class; returns the stage's plan.

    ``first_layer`` is the block's first global layer (0-based; megatron's pipeline offset).
    """
    source, shared, no_indexer = classes()
    from megatron.core.transformer.spec_utils import ModuleSpec

    layers = block_spec.layer_specs
    plan = StagePlan(share.kinds, first_layer, len(layers))
    if first_layer + len(layers) > len(share.kinds):
        raise IndexShareError(
            f"layers {first_layer}..{first_layer + len(layers) - 1} of a {len(share.kinds)}-layer model"
        )
    for i, layer in enumerate(layers):
        layer = layers[i] = copy.deepcopy(layer)  # megatron reuses one spec object for many layers
        kind = share.kinds[first_layer + i]
        found = list(_dsa_specs(layer))
        if len(found) != 1:
            raise IndexShareError(
                f"layer {first_layer + i}: expected one DSA attention in its spec, found {len(found)}"
            )
        owner, field, attention = found[0]
        submodules = attention.submodules
        if kind == SHARED:
            submodules = dataclasses.replace(submodules, indexer=ModuleSpec(module=no_indexer))
        params = {**dict(attention.params or {}), "index_share": share}
        setattr(
            owner, field, ModuleSpec(module=source if kind == FULL else shared, params=params, submodules=submodules)
        )
    return plan


def apply_to_glm5_block(block_spec: Any, hf_config: Any, config: Any, vp_stage: int | None = None) -> Any:
    """A GLM-5 / GLM-5.2 decoder block spec with IndexShare layers; registers this process's stage plan.

    Every ``glm_moe_dsa`` model gets the reference's indexer numerics (key norm eps 1e-6, no
    Hadamard rotation), also GLM-5, whose layers are all full.
    """
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from verl_npu.models.glm5.config import indexer_types

    share = IndexShareSpec(indexer_types(hf_config))
    register_stage(apply_to_block_spec(block_spec, share, get_transformer_layer_offset(config, vp_stage)))
    return block_spec
