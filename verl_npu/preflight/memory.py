"""Per-device (HBM) and per-node (host RAM) memory of a megatron training launch in verl, before it queues.

``estimate(shape, parallelism, precision, activations, offload, capacity_bytes=...)`` gives, for every
pipeline stage, the bytes on one device by component in two colocated phases, and the host RAM the
offload arenas take on the worst node. Pure arithmetic: no torch, no devices.

Assumptions (each one a reading of megatron-core 0.18 / verl 0.9.1 / verl_npu, or a stated choice):
  * Static state per device. Dense matmul weights, embedding and output layer are split over TP;
    norms, router, DSA indexer and (TE spec) MLA down projections are replicated; routed experts
    over EP x ETP. Weights in ``params_dtype``; DDP gradient buffer in fp32 when
    grad_reduce_in_fp32 (verl's default), else the precision-aware ``main_grads_dtype`` or the
    params dtype. Bucket padding (64-element starts, lcm(dp, 128) ends) is ignored (< 0.1%).
  * Distributed optimizer: main params and moments are sharded over the data-parallel-with-context
    group (dp x cp) for dense params and over expert-DP = world / (pp x ep x etp) for experts. Main
    params are an fp32 clone of bf16 params (none for fp32 params). Precision-aware optimizer (TE
    FusedAdam): main params held by the optimizer as int16 remainders (store_param_remainders, bf16
    params, fp32 main_params_dtype) or in main_params_dtype; moments in exp_avg(_sq)_dtype. Without
    the distributed optimizer nothing is sharded.
  * Activations: what autograd saves in megatron's local-spec modules, tensor by tensor, with fused
    norms (a norm saves its input and fp32 1/rms, as npu_rms_norm and TE do), unfused SwiGLU (fc1
    output, silu output, the ``x_linear + glu_linear_offset`` copy and the fc2 input), RoPE, no
    bias. ``attention_kernel="unfused"``: megatron's DotProductAttention saves the fp32 softmax
    output and its bf16 copy ([b, heads/tp, s, s]) and the [s, s] causal mask per layer; forward
    holds the bf16 scores and an fp32 working copy besides, backward an fp32 gradient, the input
    gradient and softmax backward's same-size workspace (seen on CUDA); a [b*heads/tp, s, s] bf16
    buffer persists (megatron's global memory buffer: "workspace"). ``"flash"`` (Ascend
    npu_fusion_attention): q, k, v, output and softmax statistics only. DSA models replace that
    core attention with DSAttention, which on verl-npu never holds an [s, s] buffer:
    ``dsa_kernel="fused"`` (MindSpeed's operators) saves softmax statistics, ``"chunked"`` (the
    dsa-* runtime patches over verl_npu.ops) one query chunk's working set at a time (budgets in
    verl_npu.ops.chunking); both save the O(s * index_topk) indices. GLM-5.2's shared DSA layers
    (IndexShare) have no indexer: indexer parameters, the indexer's activations and the top-k
    indices are counted on full layers only (a shared layer attends over the saved top-k of the
    most recent full layer). The top-k is int64 [b, s/cp, k] with k = min(index_topk, seq): CP
    splits the queries, and with TP + SP DSA runs on the gathered sequence. MoE: balanced
    routing, s*b*topk*etp/sp token copies per rank's experts. Sequence parallel divides what norms
    and linears save by TP; CP divides s. bench/memory_estimate.py checks all this against
    megatron-core on a GPU (bench/results/memory_estimate_h200.json).
  * Pipeline 1F1B: stage i holds min(pp - i, num_microbatches) micro-batches in flight (interleaved
    VPP multiplies by 1 + (pp-1)/(pp*vpp)); the last stage also holds the vocab-parallel cross
    entropy's fp32 softmax [s, b, vocab/tp] and, at the loss, the bf16 logits. Full recompute keeps
    one input per checkpointed chunk and re-materialises one chunk at a time in backward; selective
    recompute (core_attn) drops the attention scores.
  * The IndexShare carry (verl_npu.engine.index_share), on glm_moe_dsa models: a stage whose next
    stage starts on a shared layer sends, per micro-batch after the activations, a 3-element int64
    header and the top-k as int32 [b, s/cp, k] on the pipeline group ("communication"). On the
    device ("carry", its own component): with full recompute, a checkpointed chunk whose first DSA
    layer is shared keeps the carry's latest top-k (int64) from its start until its backward; a
    chunk starting on a full layer keeps none. Without checkpointing the full layers' top-k are
    saved activations already, and only the received top-k (saved by the stage's leading shared
    layers for their backward) is extra. GLM-5 (no shared layers) keeps none. Forward-only
    (log-prob) passes keep none. Interleaved (VPP) layouts carry nothing (the build plan refuses
    those that would need a carry).
  * Phases (verl colocates the actor with the rollout engine): "train" = weights + grads + optimizer
    + activations + workspace + overhead, all resident (verl onloads everything for the update);
    "rollout" = what stays on the device while the actor is offloaded (param_offload moves the bf16
    params to the host and releases the grad buffer; optimizer_offload moves main params and moments)
    + gpu_memory_utilization x capacity that vLLM reserves. vLLM's KV cache and weights are assumed
    released (sleep mode) during training. ``fits`` needs both phases within capacity.
  * Host RAM: verl_npu's OffloadManager keeps one host arena per offloaded kind (params, optimizer;
    grads are released, not copied), and an arena's host bytes are what verl_npu.engine.host_arena
    says for ``platform``: on "ascend" power-of-two pinned chunks summing to the kind's bytes rounded
    up to 4 KiB (torch_npu's pinned allocator rounds each block to a power of two, so one block would
    take up to 2x); on "cuda" one exact allocation pinned by cudaHostRegister; on "cpu" one exact
    pageable allocation. Ranks are laid out megatron's default "tp-cp-ep-dp-pp" (pp outermost):
    rank r is in stage r // (world / pp); a node holds devices_per_node consecutive ranks, and the
    worst node is reported. Every node also holds the rollout's sleep-mode weight copies
    (``rollout_host_bytes_per_node``, computed by verl_npu.preflight.rollout): on Ascend verl sleeps vLLM
    at level 1, which keeps a pinned copy of each rollout rank's weight allocations while the actor trains.
    With routing replay the busiest node also holds the step's MoE routes (:class:`ReplayRoutes`).
  * ``overhead_bytes`` (default 2 GiB) stands for the runtime's own allocations: communication
    buffers, kernel workspaces, allocator fragmentation. It is a knob, not a measurement.
"""

from __future__ import annotations

import dataclasses

from verl_npu.dtypes import nbytes as _bytes
from verl_npu.dtypes import parse as _dtype
from verl_npu.engine.build_plan import PLATFORMS
from verl_npu.engine.host_arena import default_strategy
from verl_npu.engine.host_arena import host_bytes as arena_host_bytes
from verl_npu.parallelism import Parallelism
from verl_npu.preflight.model_shape import ModelShape

GiB = 2**30


def node_ranks(world: int, devices_per_node: int) -> list[range]:
    """The global ranks of each node (devices_per_node consecutive ranks)."""
    return [range(n, min(n + devices_per_node, world)) for n in range(0, world, devices_per_node)]


def node_stages(p: Parallelism, devices_per_node: int) -> list[tuple[int, ...]]:
    """The pipeline stages whose ranks each node holds."""
    return [tuple(sorted({p.stage_of_rank(r) for r in ranks})) for ranks in node_ranks(p.devices, devices_per_node)]


@dataclasses.dataclass(frozen=True)
class Precision:
    params_dtype: str = "bf16"
    grad_reduce_in_fp32: bool = True  # verl's DDP default
    use_distributed_optimizer: bool = True
    optimizer: str = "adam"
    use_precision_aware_optimizer: bool = False
    main_params_dtype: str = "fp32"
    main_grads_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    store_param_remainders: bool = True  # megatron's default (TE >= 2.1)

    @property
    def grad_dtype(self) -> str:
        if self.use_precision_aware_optimizer:
            return self.main_grads_dtype  # verl keeps the DDP buffer dtype equal to main_grads_dtype
        return "fp32" if self.grad_reduce_in_fp32 else self.params_dtype

    def optimizer_bytes_per_param(self) -> dict[str, tuple[str, int]]:
        """Optimizer tensors per parameter: name -> (dtype, bytes)."""
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer {self.optimizer!r}: only adam and sgd are modelled")
        pa = self.use_precision_aware_optimizer
        if pa and self.store_param_remainders and _dtype(self.params_dtype) == "bf16":
            main: str | None = "int16" if _dtype(self.main_params_dtype) == "fp32" else self.main_params_dtype
        elif pa:
            main = self.main_params_dtype
        else:
            main = "fp32" if _bytes(self.params_dtype) < 4 else None  # fp32 params are their own main params
        out = {"main_params": (main, _bytes(main))} if main else {}
        if self.optimizer == "sgd":
            return out | {"momentum": ("fp32", 4)}
        for name, dtype in (("exp_avg", self.exp_avg_dtype), ("exp_avg_sq", self.exp_avg_sq_dtype)):
            out[name] = (dtype if pa else "fp32", _bytes(dtype if pa else "fp32"))
        return out


@dataclasses.dataclass(frozen=True)
class Activations:
    micro_batch_size: int = 1
    seq_len: int = 4096  # tokens per micro-batch sequence
    num_microbatches: int | None = None  # None: enough to fill the pipeline (>= pp)
    recompute_granularity: str | None = None  # None, "selective" (core attention) or "full"
    recompute_method: str | None = None  # "uniform" or "block" (full recompute)
    recompute_num_layers: int | None = None
    attention_kernel: str = "flash"  # "flash" (fused, no s^2 buffers) or "unfused" (megatron local)
    # DSA models: "fused" (MindSpeed's fused DSA operators) or "chunked" (verl-npu's dsa-* runtime patches)
    dsa_kernel: str = "fused"
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0


@dataclasses.dataclass(frozen=True)
class Offload:
    param_offload: bool = False  # bf16 params to host, grad buffer released, while the rollout runs
    optimizer_offload: bool = False  # main params + moments to host


@dataclasses.dataclass(frozen=True)
class IndexShareStage:
    """A pipeline stage's DSA layers under IndexShare and what the top-k carry costs it (one device)."""

    full_layers: tuple[int, ...]  # global layer numbers (0-based) with their own indexer
    shared_layers: tuple[int, ...]  # reusing the most recent full layer's top-k
    receives: bool  # starts on a shared layer: the previous stage's top-k comes with the activations
    sends: bool  # the next stage starts on a shared layer
    topk_bytes: int  # one int64 top-k [b, s/cp, k] of one micro-batch
    carry_bytes_per_microbatch: int  # device memory the carry adds per in-flight micro-batch
    carry_bytes: int  # ... for all micro-batches in flight (the "carry" component)
    send_bytes_per_microbatch: int  # to the next stage: 3 x int64 header + int32 top-k (0 when it sends none)
    receive_bytes_per_microbatch: int  # from the previous stage, likewise

    def layout(self, stage: int) -> str:
        """E.g. "stage 1: layers 9-18, full 10, 14, 18; starts shared (carry from stage 0)"."""
        layers = sorted(self.full_layers + self.shared_layers)
        span = f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}" if layers else "none"
        full = "all full" if not self.shared_layers else f"full {', '.join(map(str, self.full_layers)) or 'none'}"
        text = f"stage {stage}: {span}, {full}"
        if self.receives:
            text += f"; starts shared (carry from stage {stage - 1})"
        if self.sends:
            text += f"; sends its top-k to stage {stage + 1}"
        return text


@dataclasses.dataclass(frozen=True)
class StageEstimate:
    stage: int
    layers: int
    moe_layers: int
    params: int  # parameters held by one device of this stage
    train: dict[str, int]  # bytes on the device during the training step, by component
    floor: dict[str, int]  # bytes left on the device while the actor is offloaded
    host_bytes: int  # host RAM the offload arenas take for one device of this stage, on the estimate's platform
    details: dict[str, str]
    index_share: IndexShareStage | None = None  # glm_moe_dsa models (IndexShare layers); None otherwise

    @property
    def train_bytes(self) -> int:
        return sum(self.train.values())

    @property
    def floor_bytes(self) -> int:
        return sum(self.floor.values())


ROUTE_BYTES = 2  # verl keeps routes as int16, the rollout's and those the old-log-prob pass records alike


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class ReplayRoutes:
    """Host RAM of the MoE routes verl 0.9.1 keeps with one step's samples for routing replay.

    Each sample carries int16 ``[tokens, layers, top_k]`` (the rollout's routes over every decoder layer, as vLLM
    captures them, which R3 replays; or the routes R2's old-log-prob pass records, one column per MoE layer), of at
    most ``tokens_per_sample`` = prompt + response tokens. Where they sit, in verl's v1 trainer:

    * TransferQueue's SimpleStorage keeps the step until it ends: sample ``i`` in storage unit ``i % storage_units``,
      the units spread round-robin over the nodes;
    * every training process (each rank of a data-parallel group alike) fetches its data-parallel share for the
      old-log-prob pass and again for the update, and the engine copies what it runs into micro-batches (the update
      first into mini-batches): a process holds its share and one more share's worth at most (the share split into
      micro-batches, or two mini-batches, the previous one and the next);
    * with the rollout's MoE load-balance metrics on, the driver fetches the whole step's routes after the update
      and pads them (two copies).

    The busiest node holds the most storage units and, besides, its processes' copies or the driver's.
    """

    mode: str  # the actor's replay mode: R2, R3, or disabled (the rollout's routes kept though nothing reads them)
    recorded: bool  # True: R2's recorded routes (MoE layers); False: the rollout's (every decoder layer)
    layers: int
    top_k: int
    samples: int  # train_batch_size x rollout.n
    tokens_per_sample: int  # max_prompt_length + max_response_length
    data_parallel: int  # the actor's data-parallel size (world / (TP x PP x CP))
    mini_batch_samples: int  # ppo_mini_batch_size x rollout.n
    storage_units: int  # TransferQueue SimpleStorage's num_data_storage_units
    nodes: int
    devices_per_node: int  # training processes per node
    driver_fetches: bool = False  # rollout.moe_load_balance_metrics_interval > 0

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.top_k * ROUTE_BYTES

    @property
    def sample_bytes(self) -> int:
        return self.tokens_per_sample * self.bytes_per_token

    @property
    def batch_bytes(self) -> int:
        return self.samples * self.sample_bytes

    @property
    def storage_samples_per_node(self) -> int:
        """Samples the busiest node's storage units hold."""
        units = _ceil_div(self.storage_units, self.nodes)
        return min(units * _ceil_div(self.samples, self.storage_units), self.samples)

    @property
    def samples_per_process(self) -> int:
        return _ceil_div(self.samples, self.data_parallel)

    @property
    def mini_batch_samples_per_process(self) -> int:
        return min(_ceil_div(self.mini_batch_samples, self.data_parallel), self.samples_per_process)

    @property
    def process_samples(self) -> int:
        """The most samples' routes one training process holds at once."""
        share = self.samples_per_process
        return share + max(share, 2 * self.mini_batch_samples_per_process)

    @property
    def storage_bytes_per_node(self) -> int:
        return self.storage_samples_per_node * self.sample_bytes

    @property
    def process_bytes(self) -> int:
        return self.process_samples * self.sample_bytes

    @property
    def process_bytes_per_node(self) -> int:
        return self.devices_per_node * self.process_bytes

    @property
    def driver_bytes(self) -> int:
        return 2 * self.batch_bytes if self.driver_fetches else 0

    @property
    def bytes_per_node(self) -> int:
        """The busiest node: its storage units, and its processes' copies or the driver's (which fetches after the
        update, when the processes have let theirs go)."""
        return self.storage_bytes_per_node + max(self.process_bytes_per_node, self.driver_bytes)

    def to_dict(self) -> dict:
        derived = ("bytes_per_token", "sample_bytes", "batch_bytes", "storage_samples_per_node", "samples_per_process",
                   "mini_batch_samples_per_process", "process_samples", "storage_bytes_per_node", "process_bytes",
                   "process_bytes_per_node", "driver_bytes", "bytes_per_node")  # fmt: skip
        return {**dataclasses.asdict(self), **{name: getattr(self, name) for name in derived}}


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    stages: tuple[StageEstimate, ...]
    capacity_bytes: int | None
    rollout_reserved_bytes: int  # gpu_memory_utilization x capacity (0 without a colocated rollout)
    host_bytes_per_node: int  # worst node
    worst_node: int
    worst_node_stages: tuple[int, ...]
    host_capacity_bytes: int | None = None
    platform: str = "ascend"  # whose offload arenas host_bytes counts
    # pinned host RAM of the rollout's sleep-mode weight copies on every node (verl_npu.preflight.rollout)
    rollout_host_bytes_per_node: int = 0
    replay_routes: ReplayRoutes | None = None  # routing replay's routes in the batch (None: replay off)

    @property
    def routes_host_bytes_per_node(self) -> int:
        return self.replay_routes.bytes_per_node if self.replay_routes is not None else 0

    @property
    def node_host_bytes(self) -> int:
        """Host RAM of the busiest node: the actor's offload arenas, the rollout's sleep-mode weight copies and the
        routing replay routes kept with the step's samples."""
        return self.host_bytes_per_node + self.rollout_host_bytes_per_node + self.routes_host_bytes_per_node

    def rollout_bytes(self, stage: StageEstimate) -> int:
        return stage.floor_bytes + self.rollout_reserved_bytes

    def headroom(self, stage: StageEstimate) -> dict[str, int | None]:
        if self.capacity_bytes is None:
            return {"train": None, "rollout": None}
        return {
            "train": self.capacity_bytes - stage.train_bytes,
            "rollout": self.capacity_bytes - self.rollout_bytes(stage) if self.rollout_reserved_bytes else None,
        }

    @property
    def fits(self) -> bool | None:
        if self.capacity_bytes is None:
            return None
        device = all(v is None or v >= 0 for s in self.stages for v in self.headroom(s).values())
        host = self.host_capacity_bytes is None or self.node_host_bytes <= self.host_capacity_bytes
        return device and host

    def to_dict(self) -> dict:
        return {
            "capacity_bytes": self.capacity_bytes,
            "rollout_reserved_bytes": self.rollout_reserved_bytes,
            "host_bytes_per_node": self.host_bytes_per_node,
            "rollout_host_bytes_per_node": self.rollout_host_bytes_per_node,
            "routes_host_bytes_per_node": self.routes_host_bytes_per_node,
            "replay_routes": self.replay_routes.to_dict() if self.replay_routes is not None else None,
            "node_host_bytes": self.node_host_bytes,
            "worst_node": self.worst_node,
            "worst_node_stages": list(self.worst_node_stages),
            "host_capacity_bytes": self.host_capacity_bytes,
            "platform": self.platform,
            "fits": self.fits,
            "stages": [
                {**dataclasses.asdict(s), "train_bytes": s.train_bytes, "floor_bytes": s.floor_bytes,
                 "headroom": self.headroom(s),
                 "dsa_layout": s.index_share.layout(s.stage) if s.index_share else None}
                for s in self.stages
            ],
        }  # fmt: skip

    def summary(self) -> str:
        gib = lambda n: f"{n / GiB:7.2f}"  # noqa: E731
        lines = ["stage layers  weights   grads   optim    acts   carry  wkspace overhead |  train   floor  GiB"]
        for s in self.stages:
            t = s.train
            lines.append(
                f"{s.stage:5} {s.layers:6} {gib(t['weights'])} {gib(t['grads'])} {gib(t['optimizer'])} "
                f"{gib(t['activations'])} {gib(t['carry'])} {gib(t['workspace'])} {gib(t['overhead'])} | "
                f"{gib(s.train_bytes)} {gib(s.floor_bytes)}"
            )
        lines += [s.index_share.layout(s.stage) for s in self.stages if s.index_share and s.index_share.shared_layers]
        lines.append(
            f"host RAM, worst node {self.worst_node} (stages {list(self.worst_node_stages)}): "
            f"{self.host_bytes_per_node / GiB:.1f} GiB offloaded + "
            f"{self.rollout_host_bytes_per_node / GiB:.1f} GiB rollout sleep copies + "
            f"{self.routes_host_bytes_per_node / GiB:.1f} GiB replay routes; fits: {self.fits}"
        )
        return "\n".join(lines)


# --- activations ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Sizes:
    s: int  # tokens of one sequence on this rank (seq_len / cp)
    b: int
    t: int  # tensor parallel size
    sp: int  # t with sequence parallel, else 1
    etp: int
    down: int = 1  # TP split of the MLA down projections' outputs (1: duplicated)
    seq: int = 0  # tokens of one whole sequence (the keys a DSA query chooses from); 0: s

    @property
    def keys(self) -> int:
        """Keys a DSA query chooses its top-k from: the whole sequence (k = min(index_topk, keys))."""
        return self.seq or self.s


def _attention(m: ModelShape, z: _Sizes, act: Activations, indexer: bool = True) -> tuple[float, float, float]:
    """(saved, transient, persistent workspace) bytes of one attention block, one micro-batch.

    The transient is the most the block holds above what it saves, in its forward or its backward.
    ``indexer=False``: a shared DSA layer (IndexShare), without an indexer and with no top-k of its own.
    """
    s, b, t, sp, h = z.s, z.b, z.t, z.sp, m.hidden_size
    tokens, a, unfused = s * b, m.num_attention_heads / t, act.attention_kernel == "unfused"
    saved = (2 * h + 4 + 2 * h) / sp * tokens  # input norm (input, fp32 rstd) + its output (projections' input)
    if m.mla:
        ql, kvl, rope, down = m.q_lora_rank or 0, m.kv_lora_rank or 0, m.qk_rope_head_dim, z.down  # kvl set: m.mla
        qk, v = m.qk_nope_head_dim + rope, m.v_head_dim
        saved += (2 * 2 * ql + 4) * tokens / down  # q norm (input, rstd) + q up projection input
        saved += (2 * (kvl + rope) + 2 * kvl + 4) * tokens / down  # kv down output (norm input) + kv up input
        saved += 2 * a * (qk + qk + v) * tokens  # q, k (RoPE'd), v
        if m.dsa and indexer:
            n, di = m.index_n_heads, m.index_head_dim
            saved += (2 * n * di + 2 * 2 * di + 4 + 2 * n) * tokens  # indexer q, k (+ LayerNorm), head weights
            saved += 8 * b * s * min(m.index_topk, z.keys)  # top-k indices (int64)
        transient = 0.0
    else:
        d, g = m.head_dim, m.num_query_groups / t
        qkv_out, q = 2 * (a + 2 * g) * d * tokens, 2 * a * d * tokens
        kept = m.qk_layernorm or (unfused and g == a)  # the qkv output stays alive through views
        if m.qk_layernorm:
            saved += q + 4 * (a + g) * tokens  # q norm input (a reshaped copy) + fp32 rstd of both norms
        saved += qkv_out * kept + q  # q after RoPE
        if unfused:
            saved += 2 * q if g < a else q  # key and value repeated to every head (g == a: key only)
        elif not kept:
            saved += 2 * 2 * g * d * tokens  # key, value
        transient = (0 if kept else qkv_out) + (0 if m.qk_layernorm else q)
    saved += 8 * s * m.qk_rope_head_dim if m.mla else 8 * s * m.head_dim  # RoPE cos / sin in bf16, for q and k
    v_dim = m.v_head_dim if m.mla else m.head_dim
    saved += 2 * a * v_dim * tokens  # attention output (output projection input)
    if m.dsa:
        return _dsa_core_attention(m, z, act, a, saved, transient, indexer)
    scores = b * a * s * s
    if not unfused:
        return saved + 64 * a * tokens, transient, 0  # + softmax max / sum ([b, n, s, 8] fp32 each on Ascend)
    drop = act.attention_dropout > 0
    probs = (4 + 2 + 3 * drop) * scores + s * s  # fp32 softmax, bf16 probs (+ mask, dropped probs), causal mask
    # forward: the bf16 scores and their fp32 working copy next to the probs; backward (measured on CUDA): fp32
    # softmax output, its fp32 gradient, the input gradient and softmax backward's workspace of the same size
    backward = 16 * scores + s * s
    if act.recompute_granularity == "selective":  # core attention recomputed: probs live only transiently
        return saved, max(transient + probs + 6 * scores, backward), 2 * scores
    return saved + probs, max(transient + 6 * scores, backward - probs), 2 * scores


def _dsa_core_attention(
    m: ModelShape, z: _Sizes, act: Activations, a: float, saved: float, transient: float, indexer: bool = True
):
    """DSAttention in place of DotProductAttention: no [s, s] buffer on either verl-npu path.

    Fused (MindSpeed's operators): softmax statistics besides what the block saves. Chunked
    (verl-npu's dsa-* runtime patches, verl_npu.ops, as they run on Ascend: the portable backend):
    nothing but q, k, v and the top-k indices is saved; a query chunk at a time holds at most four
    fp32 score-sized tensors of the attention's chunk budget (forward, and backward's recompute) or
    two of the indexer top-k's. Not counted: the indexer KL loss's chunks (only with
    dsa_indexer_loss_coeff > 0) and, on CUDA, the Triton kernel's saved selection bitmask (s^2/8 bytes).
    """
    from verl_npu.ops.chunking import DSA_ATTENTION_CHUNK_ELEMENTS, DSA_INDEXER_CHUNK_ELEMENTS

    s, b = z.s, z.b
    if act.dsa_kernel == "fused":
        return saved + 64 * a * s * b, transient, 0
    attention_chunk = 4 * 4 * min(DSA_ATTENTION_CHUNK_ELEMENTS, b * a * s * s)
    indexer_chunk = 2 * 4 * min(DSA_INDEXER_CHUNK_ELEMENTS, b * m.index_n_heads * s * s) if indexer else 0
    return saved, max(transient, attention_chunk, indexer_chunk), 0


def _mlp(m: ModelShape, z: _Sizes, moe: bool) -> float:
    """Saved bytes of one MLP / MoE block (its norm included), one micro-batch."""
    s, b, t, sp, h = z.s, z.b, z.t, z.sp, m.hidden_size
    tokens = s * b
    saved = (2 * h + 4 + 2 * h) / sp * tokens  # pre-MLP norm (input, rstd) + its output (fc1 / router input)
    ffn = 10 if m.gated_linear_unit else 4  # gated: fc1 output (2f), silu output, x_linear copy, fc2 input
    if not moe:
        return saved + ffn * m.ffn_hidden_size / t * tokens
    routed = tokens * m.router_topk * z.etp / sp  # token copies entering this rank's experts (balanced routing)
    saved += (2 * m.num_experts + 12 * m.router_topk + 2 * h) * tokens / sp  # routing map, top-k, probs, output
    saved += (2 * h + 2) * routed  # permuted tokens and their probs
    saved += (ffn + 2) * m.moe_ffn_hidden_size / z.etp * routed  # + the probs-weighted activation
    return saved + ffn * m.shared_expert_ffn_hidden_size / t * tokens


def _sizes(p: Parallelism, act: Activations, mla_down_proj_duplicated: bool = True) -> _Sizes:
    return _Sizes(
        s=act.seq_len // p.cp, b=act.micro_batch_size, t=p.tp, sp=p.tp if p.sequence_parallel else 1, etp=p.etp,
        down=1 if mla_down_proj_duplicated else p.tp, seq=act.seq_len,
    )  # fmt: skip


def _in_flight(p: Parallelism, act: Activations, stage: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B."""
    return min(p.pp - stage, act.num_microbatches or p.pp)


def _activation_bytes(
    m, p: Parallelism, act: Activations, stage: int, layers: list[int], mla_down_proj_duplicated: bool
) -> tuple[int, int, str]:
    """(peak activation bytes, persistent workspace bytes, details) of one pipeline stage."""
    z = _sizes(p, act, mla_down_proj_duplicated)
    tokens, h = z.s * z.b, m.hidden_size
    # each layer's attention: with or without its own DSA indexer (IndexShare's shared layers have none)
    kinds = [not m.dsa or m.full_indexer(i) for i in layers]
    blocks = {kind: _attention(m, z, act, indexer=kind) for kind in set(kinds)}
    attn = [blocks[kind][0] for kind in kinds]
    transient = max((blocks[kind][1] for kind in blocks), default=0)
    workspace = max((blocks[kind][2] for kind in blocks), default=0)
    masks = 2 * h / z.sp * tokens if act.hidden_dropout > 0 else 0  # bias-dropout-add masks (bool), two a layer
    full = [a + masks + _mlp(m, z, bool(m.is_moe) and m.is_moe[i]) for a, i in zip(attn, layers, strict=True)]
    last = stage == p.pp - 1
    head = ((2 * h + 4 + 2 * h) / z.sp + 4 * m.vocab_size / z.t) * tokens if last else 0  # norm, fp32 softmax
    logits = 2 * m.vocab_size / z.t * tokens if last else 0  # bf16 logits, alive next to the fp32 copy
    # the current micro-batch: peaks at its last attention forward, at the loss, or re-materialising a chunk
    n = act.recompute_num_layers or 1
    every = list(range(len(layers)))
    if act.recompute_granularity == "full" and act.recompute_method == "block":
        kept = n * 2 * h / z.sp * tokens + sum(full[n:])
        chunks = [[i] for i in every[:n]]
    elif act.recompute_granularity == "full":
        chunks = [every[i : i + n] for i in range(0, len(every), n)]
        kept = len(chunks) * 2 * h / z.sp * tokens
    else:
        kept, chunks = sum(full), [every]
    # a chunk being (re)computed holds its layers' activations up to its last attention, plus that one's transient
    forward = max((sum(full[i] for i in c[:-1]) + attn[c[-1]] + transient for c in chunks if c), default=0)
    if act.recompute_granularity == "full":  # backward re-materialises a whole chunk next to the checkpoints
        grads = 2 * 2 * h / z.sp * tokens  # the chunk's output gradient and its input gradient
        rematerialised = max((sum(full[i] for i in c) for c in chunks), default=0)
        current = max(kept + head + logits, kept + max(forward, rematerialised + grads))
    else:
        current = max(kept + head + logits, forward)
    saved = kept + head
    inflight = _in_flight(p, act, stage)
    factor = 1 + (p.pp - 1) / (p.pp * p.vpp) if p.vpp and p.vpp > 1 else 1
    peak = ((inflight - 1) * saved + current) * factor
    details = (
        f"{inflight} micro-batch(es) in flight, {saved / GiB:.3f} GiB saved each, {current / GiB:.3f} GiB at the"
        f" current one's peak" + (f", x {factor:.3f} (interleaved)" if factor != 1 else "")
    )
    return int(peak), int(workspace), details


def _held_top_k(full: list[bool], receives: bool, act: Activations) -> int:
    """How many top-k tensors a stage keeps per in-flight micro-batch beyond its activations.

    A checkpointed chunk whose first DSA layer is shared keeps the carry's latest top-k until its
    backward (``index_share.recompute_safe``; a chunk starting on a full layer publishes its own
    first); layers run without checkpointing save their top-k with autograd, which the activations
    count for full layers' own top-k but not for the one received from the previous stage.
    """
    n, layers = act.recompute_num_layers or 1, range(len(full))
    if act.recompute_granularity != "full":
        checkpointed: list[list[int]] = []
    elif act.recompute_method == "block":
        checkpointed = [[i] for i in layers[:n]]
    else:
        checkpointed = [list(layers[i : i + n]) for i in range(0, len(full), n)]
    chunk_of = {i: c for c in checkpointed for i in c}
    held: set[int | str] = set()  # full layers' indices, or "received" for the previous stage's carry
    latest: int | str | None = "received" if receives else None
    for i in layers:
        chunk = chunk_of.get(i)
        if not full[i] and latest is not None:
            if chunk is None and latest == "received":
                held.add(latest)  # saved by autograd, and not one of this stage's activations
            elif chunk is not None and i == chunk[0]:
                held.add(latest)  # the chunk reads the carry before any full layer of its own
        if full[i]:
            latest = i
    return len(held)


def _index_share(
    m: ModelShape, p: Parallelism, act: Activations, stage: int, layers: list[int], counts: list[int]
) -> IndexShareStage | None:
    """The stage's full / shared DSA layers and the top-k carry's memory and traffic (see the module docstring)."""
    if not (m.dsa and m.index_share):
        return None
    from verl_npu.engine.index_share import stage_plans

    plan = stage_plans(m.indexer_kinds(), counts)[stage]
    interleaved = bool(p.vpp and p.vpp > 1)  # no carry: the build plan refuses VPP chunks that start shared
    receives, sends = plan.receives and not interleaved, plan.sends and not interleaved
    z = _sizes(p, act)
    k = min(m.index_topk, z.keys)
    topk = 8 * z.b * z.s * k  # int64
    full = tuple(i for i in layers if m.full_indexer(i))
    per_microbatch = _held_top_k([m.full_indexer(i) for i in layers], receives, act) * topk
    message = 3 * 8 + 4 * z.b * z.s * k  # int64 header + int32 top-k
    return IndexShareStage(
        full_layers=full,
        shared_layers=tuple(i for i in layers if not m.full_indexer(i)),
        receives=receives,
        sends=sends,
        topk_bytes=topk,
        carry_bytes_per_microbatch=per_microbatch,
        carry_bytes=per_microbatch * _in_flight(p, act, stage),
        send_bytes_per_microbatch=message if sends else 0,
        receive_bytes_per_microbatch=message if receives else 0,
    )


# --- the estimate --------------------------------------------------------------------------------
def estimate(
    shape: ModelShape,
    parallelism: Parallelism | None = None,
    precision: Precision | None = None,
    activations: Activations | None = None,
    offload: Offload | None = None,
    *,
    capacity_bytes: int | None = None,
    rollout_gpu_memory_utilization: float | None = None,
    overhead_bytes: int = 2 * GiB,
    host_capacity_bytes: int | None = None,
    platform: str = "ascend",
    rollout_host_bytes_per_node: int = 0,
    devices_per_node: int = 16,
    mla_down_proj_duplicated: bool = True,
) -> MemoryEstimate:
    """``platform`` ("ascend", "cuda" or "cpu") decides how much host RAM an offload arena takes;
    ``rollout_host_bytes_per_node``: the rollout's sleep-mode copies on every node (verl_npu.preflight.rollout);
    ``devices_per_node``: the ranks of one node (host RAM is per node); ``mla_down_proj_duplicated``: the TE spec's
    MLA q/kv down projections, replicated over TP (False: the local spec's, TP-split).

    ``parallelism`` defaults to one device; sizes megatron would refuse raise ParallelismError (a ValueError)."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform {platform!r}: use one of {', '.join(PLATFORMS)}")
    p, prec = parallelism or Parallelism(world=1), precision or Precision()
    act, off = activations or Activations(), offload or Offload()
    if act.attention_kernel not in ("flash", "unfused"):
        raise ValueError(f"attention_kernel {act.attention_kernel!r}: use 'flash' or 'unfused'")
    if act.dsa_kernel not in ("fused", "chunked"):
        raise ValueError(f"dsa_kernel {act.dsa_kernel!r}: use 'fused' or 'chunked'")
    if act.recompute_granularity not in (None, "selective", "full"):
        raise ValueError(f"recompute_granularity {act.recompute_granularity!r}: use None, 'selective' or 'full'")
    p.validate(shape.num_layers, shape.num_experts)
    counts = p.stage_layers(shape.num_layers)
    optim = prec.optimizer_bytes_per_param()
    w_bytes, g_bytes = _bytes(prec.params_dtype), _bytes(prec.grad_dtype)
    dense_shard = p.dp * p.cp if prec.use_distributed_optimizer else 1
    expert_shard = p.expert_dp if prec.use_distributed_optimizer else 1
    stages, start = [], 0
    for stage, n in enumerate(counts):
        layers = list(range(start, start + n))
        start += n
        dense_share = expert_share = 0.0  # this rank's parameters, fractional until rounded below
        for i in layers:
            lp = shape.layer_params(i)
            down = 0
            if shape.mla and not mla_down_proj_duplicated:  # local spec: down projections TP-split
                latent = (shape.q_lora_rank or 0) + (shape.kv_lora_rank or 0) + shape.qk_rope_head_dim
                down = shape.hidden_size * latent
            dense_share += (lp.tp + down) / p.tp + lp.replicated - down
            expert_share += lp.expert / (p.ep * p.etp)
        if stage == 0:
            dense_share += shape.embedding_params() / p.tp
        if stage == p.pp - 1:
            dense_share += shape.hidden_size  # final norm
            output = shape.output_params() or (shape.embedding_params() if p.pp > 1 else 0)
            dense_share += output / p.tp
        dense, expert = int(dense_share), int(expert_share)
        params = dense + expert
        opt_bytes = sum(nb for _, nb in optim.values())
        optimizer = int(dense * opt_bytes / dense_shard + expert * opt_bytes / expert_shard)
        acts, workspace, act_details = _activation_bytes(shape, p, act, stage, layers, mla_down_proj_duplicated)
        share = _index_share(shape, p, act, stage, layers, counts)
        train = {
            "weights": params * w_bytes,
            "grads": params * g_bytes,
            "optimizer": optimizer,
            "activations": acts,
            "carry": share.carry_bytes if share else 0,
            "workspace": workspace,
            "overhead": overhead_bytes,
        }
        floor = {
            "weights": 0 if off.param_offload else train["weights"],
            "grads": 0 if off.param_offload else train["grads"],
            "optimizer": 0 if off.optimizer_offload else optimizer,
            "activations": 0,
            "carry": 0,
            "workspace": workspace,
            "overhead": overhead_bytes,
        }
        arenas = [train["weights"]] * off.param_offload + [optimizer] * off.optimizer_offload
        host = sum(arena_host_bytes(platform, nbytes) for nbytes in arenas)
        shard = (
            f"dense over dp*cp={dense_shard}, experts over expert-dp={expert_shard}"
            if prec.use_distributed_optimizer
            else "not sharded (no distributed optimizer)"
        )
        details = {
            "weights": f"{dense:,} dense + {expert:,} expert params in {prec.params_dtype}",
            "grads": f"DDP grad buffer in {prec.grad_dtype}" + (", released while offloaded" * off.param_offload),
            "optimizer": ", ".join(f"{k} {dt}" for k, (dt, _) in optim.items()) + f"; {shard}",
            "activations": act_details,
            "carry": _carry_details(share, act),
            "workspace": "unfused attention's global memory buffer" if workspace else "none",
            "overhead": "assumed: communication buffers, workspaces, fragmentation",
            "host": f"{len(arenas)} offload arena(s), {default_strategy(platform)} on {platform}" if arenas else "none",
        }
        moe_layers = sum(1 for i in layers if shape.is_moe and shape.is_moe[i])
        stages.append(StageEstimate(stage, n, moe_layers, params, train, floor, host, details, share))
    nodes = node_ranks(p.devices, devices_per_node)
    per_node = [sum(stages[p.stage_of_rank(r)].host_bytes for r in ranks) for ranks in nodes]
    worst = max(range(len(per_node)), key=per_node.__getitem__)
    reserved = int((rollout_gpu_memory_utilization or 0) * (capacity_bytes or 0))
    return MemoryEstimate(
        stages=tuple(stages),
        capacity_bytes=capacity_bytes,
        rollout_reserved_bytes=reserved,
        host_bytes_per_node=per_node[worst],
        worst_node=worst,
        worst_node_stages=node_stages(p, devices_per_node)[worst],
        host_capacity_bytes=host_capacity_bytes,
        platform=platform,
        rollout_host_bytes_per_node=rollout_host_bytes_per_node,
    )


def _carry_details(share: IndexShareStage | None, act: Activations) -> str:
    if share is None:
        return "none (no IndexShare layers)"
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    kept = share.carry_bytes_per_microbatch // share.topk_bytes if share.topk_bytes else 0
    why = (
        "checkpointed chunks starting on a shared layer keep the latest top-k until their backward"
        if act.recompute_granularity == "full"
        else "the received top-k, saved by the leading shared layers"
    )
    text = f"{kept} int64 top-k of {mib(share.topk_bytes)} per in-flight micro-batch ({why})" if kept else "none kept"
    if share.receives:
        text += f"; receives {mib(share.receive_bytes_per_microbatch)} per micro-batch"
    if share.sends:
        text += f"; sends {mib(share.send_bytes_per_microbatch)} per micro-batch"
    return text
