"""The vLLM rollout replica, as verl 0.9.1 starts it and vllm-ascend 0.23 builds it: does it start, and what it costs.

Three questions about one rollout rank (docs/preflight_rollout.md states each formula and the upstream code it
follows; the vLLM and vllm-ascend facts are contracts in verl_npu/contracts/):

* **The KV cache fit.** vLLM starts only if one request of ``max_model_len`` tokens fits in the KV-cache memory it
  has: ``gpu_memory_utilization`` x the device's memory, less the rollout's weights on the rank and what its
  profiling run peaks at (:data:`PROFILE_RESERVE_BYTES`, an assumption). verl passes the model's
  ``max_position_embeddings`` when ``actor_rollout_ref.rollout.max_model_len`` is unset. Per token and layer,
  vllm-ascend caches (bf16) the MLA latent and its rope part, plus the DSA indexer's key on layers with an indexer
  (GLM-5.2's "shared" layers have none); the latent is replicated over TP. Memory is taken in blocks of
  :data:`ASCEND_BLOCK_SIZE` tokens. A FAIL names the key and the largest ``max_model_len`` that fits.
* **Graph capture vs the weight sync.** After each weight sync verl runs ``process_weights_after_loading`` again.
  vllm-ascend's MoE method turns the experts back into the layout its wake-up gave them, which on the default path
  keeps their storage (so graphs captured at start still read the synced weights), but with fused MC2 on it casts
  them to FRACTAL_NZ into new storage: graphs captured at start then read the old experts (any cudagraph_mode with
  graphs: only ``enforce_eager=True`` survives). With NZ weights (``VLLM_ASCEND_ENABLE_NZ`` not 0) vllm-ascend's
  wake-up refuses to run at the first weight sync.
* **Host RAM of sleep mode.** On Ascend verl sleeps vLLM at level 1, which copies every weight allocation of the
  rank to its own pinned host block (rounded up to a power of two by torch's pinned allocator,
  :func:`verl_npu.engine.host_arena.next_power_of_two`), kept while the actor trains. Every rank of a node holds
  one copy of its rollout weights.

Pure arithmetic on the launch's typed values (verl_npu.preflight.values) and the model's shape; no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from verl_npu.checks import FAIL, OK, WARN, Check
from verl_npu.dtypes import nbytes
from verl_npu.engine.host_arena import next_power_of_two
from verl_npu.errors import UserError
from verl_npu.preflight import unknowns
from verl_npu.preflight.model_shape import ModelShape
from verl_npu.preflight.values import ENGINE, ROLLOUT, RolloutValues

GiB, MiB = 2**30, 2**20
ASCEND_BLOCK_SIZE = 128  # vllm-ascend's refresh_block_size: 128 whenever prefix caching or chunked prefill is on
VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of 64 before splitting it over TP
# What vLLM's profiling run adds to the weights before the KV cache gets the rest of its budget: the peak of a
# dummy forward of max_num_batched_tokens and of the sampler, plus memory torch does not allocate (HCCL buffers).
# An assumption, like the training estimate's overhead: vllm-ascend measures it at start, preflight cannot.
PROFILE_RESERVE_BYTES = 4 * GiB
# torch's device caching allocator, under vLLM's sleep-mode memory pool: a tensor of more than 1 MiB gets a
# segment of its own rounded up to 2 MiB; smaller ones share 2 MiB segments. Each segment is one sleep-mode
# allocation, copied to one pinned host block.
SMALL_TENSOR, SEGMENT_ROUNDING = MiB, 2 * MiB
MAX_MODEL_LEN = f"{ROLLOUT}.max_model_len"
ENFORCE_EAGER = f"{ROLLOUT}.enforce_eager"
FUSED_MC2_VARIABLE = "VLLM_ASCEND_ENABLE_FUSED_MC2"  # vllm-ascend: 0 (default), 1 or 2
NZ_VARIABLE = "VLLM_ASCEND_ENABLE_NZ"  # vllm-ascend: default 1; verl sets 0 in vLLM's workers when it is unset


# --- the rollout's weights on one rank ------------------------------------------------------------------------
def weight_tensors(shape: ModelShape, tp: int, expert_split: int, *, absorbed: bool = True) -> list[int]:
    """Elements of each weight tensor one rollout rank holds, as vLLM's deepseek_v2 / llama-style modules split them.

    ``tp``: the rollout's TP; ``expert_split``: how many ranks share the routed experts (TP x DP: vLLM's expert
    parallel size is TP x DP, and without EP its fused MoE splits the experts' matrices over TP x DP). Split over TP:
    attention heads, the MLP and shared experts, the vocabulary (padded to 64); replicated: norms, the router, MLA's
    down projections and the DSA indexer (full layers only). ``absorbed``: MLA's absorbed copies of kv_b_proj
    (vllm-ascend's W_UK_T and W_UV, made at load next to kv_b_proj, which verl's GLM-5.2 patch keeps).
    The MTP layer is not built (verl's rollout runs without it; preflight refuses rollout MTP on GLM-5).
    """
    h, t = shape.hidden_size, tp
    heads = shape.num_attention_heads // t or 1
    tensors: list[int] = []
    for layer in range(shape.num_layers):
        tensors += [h, h]  # input and post-attention norms
        if shape.mla:
            ql, kvl, rope = shape.q_lora_rank or 0, shape.kv_lora_rank or 0, shape.qk_rope_head_dim
            qk, nope, v = shape.qk_nope_head_dim + rope, shape.qk_nope_head_dim, shape.v_head_dim
            bias = int(shape.qkv_bias)
            if ql:
                tensors += [(ql + kvl + rope) * (h + bias), ql, heads * qk * ql]  # fused q_a/kv_a, q norm, q_b
            else:
                tensors += [heads * qk * h, (kvl + rope) * (h + bias)]
            tensors += [kvl, heads * (nope + v) * kvl, h * heads * v + h * bias]  # kv norm, kv_b, o_proj
            if absorbed:
                tensors += [heads * nope * kvl, heads * kvl * v]  # W_UK_T, W_UV
            if shape.dsa and shape.full_indexer(layer):
                n, d = shape.index_n_heads, shape.index_head_dim
                tensors += [n * d * (ql or h), (d + n) * h, 2 * d]  # wq_b, wk + weights_proj, k_norm
        else:
            d = shape.head_dim
            kv_heads = max(shape.num_query_groups // t, 1)  # vLLM replicates KV heads when TP exceeds them
            tensors += [(heads + 2 * kv_heads) * d * h, h * heads * d]
            if shape.qkv_bias:
                tensors.append((heads + 2 * kv_heads) * d)
            if shape.proj_bias:
                tensors.append(h)
            if shape.qk_layernorm:
                tensors += [d, d]
        gated = 2 if shape.gated_linear_unit else 1
        if shape.is_moe and shape.is_moe[layer]:
            e, f = shape.num_experts, shape.moe_ffn_hidden_size
            tensors += [e * h, e]  # router, its score-correction bias
            tensors += [e * gated * f * h // expert_split, e * f * h // expert_split]  # w13, w2
            if shape.shared_expert_ffn_hidden_size:
                s = shape.shared_expert_ffn_hidden_size // t
                tensors += [gated * s * h, h * s]
        else:
            f = shape.ffn_hidden_size // t
            tensors += [gated * f * h, h * f]
    vocab = -(-shape.vocab_size // VOCAB_PADDING) * VOCAB_PADDING // t
    tensors += [vocab * h, h]  # embedding, final norm
    if not shape.tie_word_embeddings:
        tensors.append(vocab * h)
    return tensors


def allocations(tensor_bytes: list[int]) -> list[int]:
    """The device allocations (sleep-mode handles) that hold these tensors: see :data:`SMALL_TENSOR`."""
    large = [-(-b // SEGMENT_ROUNDING) * SEGMENT_ROUNDING for b in tensor_bytes if b > SMALL_TENSOR]
    small = sum(b for b in tensor_bytes if b <= SMALL_TENSOR)
    return large + [SEGMENT_ROUNDING] * -(-small // SEGMENT_ROUNDING)


# --- the KV cache ----------------------------------------------------------------------------------------------
def kv_bytes_per_token(shape: ModelShape, tp: int, dtype_bytes: int) -> tuple[int, ...]:
    """Bytes of KV cache one token takes on one rank, per layer, as vllm-ascend's model runner lays them out.

    DSA models (``index_topk`` set): the MLA latent and rope key (replicated over TP) and, on layers with their own
    indexer, the indexer's key. Other MLA models: latent and rope key. Other models: a key and a value per KV head
    on the rank (vLLM replicates KV heads when TP exceeds them).
    """
    per_layer = []
    for layer in range(shape.num_layers):
        if shape.mla:
            elements = (shape.kv_lora_rank or 0) + shape.qk_rope_head_dim
            if shape.dsa and shape.full_indexer(layer):
                elements += shape.index_head_dim
        else:
            elements = 2 * max(shape.num_query_groups // tp, 1) * shape.head_dim
        per_layer.append(elements * dtype_bytes)
    return tuple(per_layer)


@dataclasses.dataclass(frozen=True)
class RolloutEstimate:
    """One rollout rank's memory as vLLM sizes it at start, and the host RAM its sleep-mode copies take."""

    capacity_bytes: int  # the device's memory (vLLM's total)
    gpu_memory_utilization: float
    weights_bytes: int  # the rank's weight allocations
    reserve_bytes: int  # the profiling run's peak and non-torch memory (assumed)
    kv_bytes_per_token: tuple[int, ...]  # per layer
    block_size: int
    max_model_len: int
    max_model_len_origin: str  # the key that set it, or "max_position_embeddings" (verl's default)
    sleep_level: int  # verl's vLLM sleep level (0: the rollout does not sleep)
    host_bytes_per_rank: int  # pinned host RAM of one rank's sleep-mode weight copies (0 below level 1)
    ranks_per_node: int

    @property
    def bytes_per_token(self) -> int:
        return sum(self.kv_bytes_per_token)

    @property
    def requested_bytes(self) -> int:
        """What vLLM may use of the device: gpu_memory_utilization x its memory."""
        return int(self.capacity_bytes * self.gpu_memory_utilization)

    @property
    def available_kv_bytes(self) -> int:
        """The KV cache's budget: the requested memory less the weights and the profiling run's reserve."""
        return self.requested_bytes - self.weights_bytes - self.reserve_bytes

    def needed_kv_bytes(self, length: int | None = None) -> int:
        """KV cache one request of ``length`` tokens (default max_model_len) needs: whole blocks on every layer."""
        length = self.max_model_len if length is None else length
        return -(-length // self.block_size) * self.block_size * self.bytes_per_token

    @property
    def largest_fitting_len(self) -> int:
        """The longest max_model_len whose one request fits in the budget (whole blocks; 0: not even one block)."""
        if self.available_kv_bytes <= 0:
            return 0
        return self.available_kv_bytes // (self.block_size * self.bytes_per_token) * self.block_size

    @property
    def fits(self) -> bool:
        return self.available_kv_bytes > 0 and self.needed_kv_bytes() <= self.available_kv_bytes

    @property
    def host_bytes_per_node(self) -> int:
        return self.host_bytes_per_rank * self.ranks_per_node

    def to_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "kv_bytes_per_token": self.bytes_per_token,
            "requested_bytes": self.requested_bytes,
            "available_kv_bytes": self.available_kv_bytes,
            "needed_kv_bytes": self.needed_kv_bytes(),
            "largest_fitting_len": self.largest_fitting_len,
            "host_bytes_per_node": self.host_bytes_per_node,
            "fits": self.fits,
        }


def sleep_level(rollout: RolloutValues, platform: str) -> int:
    """verl 0.9.1's vLLM sleep level: 1 on NPU (and for MTP rollouts), 2 otherwise; 0 when it never sleeps."""
    if not (rollout.enable_sleep_mode and rollout.free_cache_engine):
        return 0
    return 1 if platform == "ascend" or rollout.mtp_rollout else 2


def estimate(
    shape: ModelShape,
    rollout: RolloutValues,
    capacity_bytes: int,
    ranks_per_node: int,
    platform: str = "ascend",
    reserve_bytes: int = PROFILE_RESERVE_BYTES,
) -> RolloutEstimate:
    """One rollout rank of ``rollout`` serving ``shape`` on a device of ``capacity_bytes``."""
    dtype = nbytes(rollout.dtype)
    tensors = [n * dtype for n in weight_tensors(shape, rollout.tp, rollout.tp * rollout.dp)]
    handles = allocations(tensors)
    if rollout.max_model_len is not None:
        length, origin = rollout.max_model_len, rollout.max_model_len_key
    else:
        length, origin = shape.max_position_embeddings or 0, "max_position_embeddings"
    block = ASCEND_BLOCK_SIZE
    if rollout.block_size is not None and not (rollout.enable_prefix_caching or rollout.enable_chunked_prefill):
        block = rollout.block_size
    level = sleep_level(rollout, platform)
    return RolloutEstimate(
        capacity_bytes=capacity_bytes,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        weights_bytes=sum(handles),
        reserve_bytes=reserve_bytes,
        kv_bytes_per_token=kv_bytes_per_token(shape, rollout.tp, dtype),
        block_size=block,
        max_model_len=length,
        max_model_len_origin=origin,
        sleep_level=level,
        host_bytes_per_rank=sum(map(next_power_of_two, handles)) if level == 1 else 0,
        ranks_per_node=ranks_per_node,
    )


# --- the checks ------------------------------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _kv_layout(result: RolloutEstimate) -> str:
    counts: dict[int, int] = {}
    for b in result.kv_bytes_per_token:
        counts[b] = counts.get(b, 0) + 1
    layers = " + ".join(f"{n} layers x {b:,} B" for b, n in sorted(counts.items(), reverse=True))
    return f"{result.bytes_per_token:,} B of KV cache per token per rank ({layers})"


def kv_cache_checks(
    result: RolloutEstimate, rollout: RolloutValues, shape: ModelShape, prompt: int, response: int
) -> list[Check]:
    """Whether vLLM starts with this max_model_len (vllm/v1/core/kv_cache_utils.py's check), and whether it
    agrees with the data's lengths."""
    checks: list[Check] = []
    budget = (
        f"{rollout.gpu_memory_utilization:g} x {_gib(result.capacity_bytes)} = {_gib(result.requested_bytes)}, less "
        f"{_gib(result.weights_bytes)} of rollout weights (TP {rollout.tp}, experts over TP x DP = "
        f"{rollout.tp * rollout.dp}) and {_gib(result.reserve_bytes)} assumed for vLLM's profiling run"
    )
    wanted = prompt + response
    if rollout.max_model_len is None and shape.max_position_embeddings is None:
        return [
            Check(
                "rollout.max-model-len",
                FAIL,
                f"{MAX_MODEL_LEN} is unset and the model config has no max_position_embeddings: verl 0.9.1's vLLM "
                "rollout raises at start ('max_position_embeddings not found')",
                fix=f"set {MAX_MODEL_LEN}={wanted} (max_prompt_length + max_response_length)",
            )
        ]
    if shape.max_position_embeddings is not None and result.max_model_len > shape.max_position_embeddings:
        checks.append(
            Check(
                "rollout.max-model-len",
                FAIL,
                f"{result.max_model_len_origin}={result.max_model_len:,} is more than the model's "
                f"max_position_embeddings ({shape.max_position_embeddings:,}): verl 0.9.1's vLLM rollout raises at "
                "start",
                fix=f"set {result.max_model_len_origin} to at most {shape.max_position_embeddings}",
            )
        )
    if result.available_kv_bytes <= 0:
        checks.append(
            Check(
                "rollout.kv-cache",
                FAIL,
                f"vLLM has no memory left for the KV cache on a rollout rank ({budget}: "
                f"{_gib(result.available_kv_bytes)}); vLLM raises at engine start",
                fix=f"raise {rollout.gpu_memory_utilization_key}, or spread the weights over more ranks "
                f"({ROLLOUT}.tensor_model_parallel_size, data_parallel_size with expert_parallel_size = TP x DP)",
            )
        )
        return checks
    needed = result.needed_kv_bytes()
    why_length = (
        f"{MAX_MODEL_LEN} is unset, so verl 0.9.1 passes the model's max_position_embeddings ({result.max_model_len:,})"
        if result.max_model_len_origin == "max_position_embeddings"
        else f"{result.max_model_len_origin}={result.max_model_len:,}"
    )
    largest = result.largest_fitting_len
    if needed > result.available_kv_bytes:
        fix = f"set {MAX_MODEL_LEN}={min(wanted, largest)}" if wanted <= largest else ""
        if fix:
            fix += f" (max_prompt_length + max_response_length; at most {largest} fits)"
        else:
            fix = (
                f"prompt + response ({wanted:,}) does not fit either (at most {largest:,} tokens): raise "
                f"{rollout.gpu_memory_utilization_key} or the rollout's TP x DP, or shorten the data's lengths"
            )
        checks.append(
            Check(
                "rollout.kv-cache",
                FAIL,
                f"{why_length}: one request of that length needs {_gib(needed)} of KV cache per rank "
                f"({_kv_layout(result)}, blocks of {result.block_size}), more than the "
                f"{_gib(result.available_kv_bytes)} vLLM has for it ({budget}): vLLM refuses to start the engine. "
                f"The largest {MAX_MODEL_LEN} that fits is {largest:,}",
                fix=fix,
            )
        )
        return checks
    checks.append(
        Check(
            "rollout.kv-cache",
            OK,
            f"{why_length}: one request needs {_gib(needed)} of the {_gib(result.available_kv_bytes)} vLLM has for "
            f"the KV cache per rank ({_kv_layout(result)}; {budget}); up to {largest:,} tokens would fit",
        )
    )
    if result.max_model_len <= prompt:
        checks.append(
            Check(
                "rollout.max-model-len",
                FAIL,
                f"{result.max_model_len_origin}={result.max_model_len:,} leaves no room to generate after a prompt of "
                f"data.max_prompt_length={prompt:,} tokens: verl's vLLM server raises for such a prompt",
                fix=f"set {MAX_MODEL_LEN}={wanted} (max_prompt_length + max_response_length)",
            )
        )
    elif result.max_model_len < wanted:
        checks.append(
            Check(
                "rollout.max-model-len",
                WARN,
                f"{result.max_model_len_origin}={result.max_model_len:,} is less than data.max_prompt_length + "
                f"data.max_response_length = {wanted:,}: verl cuts each response to what the prompt leaves of it",
                fix=f"set {MAX_MODEL_LEN}={wanted} if {largest:,} >= {wanted:,} (it fits)",
            )
        )
    return checks


def _env_level(env: Mapping[str, str], name: str) -> tuple[int | None, Check | None]:
    """An integer vllm-ascend reads from the environment (None: unset), or a FAIL naming a value it cannot read."""
    from verl_npu import inputs

    raw = env.get(name)
    if raw is None:
        return None, None
    if unknowns.contains(raw):
        return None, Check(
            "rollout.graph-mode", FAIL, f"{name}={raw}: only known when the launch runs; preflight needs its value"
        )
    try:
        return inputs.integer(name, raw, minimum=0, maximum=2, source="the launch's environment"), None
    except UserError as exc:
        return None, Check("rollout.graph-mode", FAIL, str(exc))


def graph_checks(rollout: RolloutValues, shape: ModelShape, env: Mapping[str, str], platform: str) -> list[Check]:
    """Graph capture against verl's weight sync on Ascend (see the module docstring); nothing off Ascend."""
    if platform != "ascend":
        return []
    fused, bad_fused = _env_level(env, FUSED_MC2_VARIABLE)
    nz, bad_nz = _env_level(env, NZ_VARIABLE)
    checks = [c for c in (bad_fused, bad_nz) if c is not None]
    # vllm-ascend reads additional_config first, then the environment variable
    fused_key = f"{ENGINE}.additional_config.enable_fused_mc2" if rollout.enable_fused_mc2 is not None else None
    fused = rollout.enable_fused_mc2 if fused_key else fused
    nz_key = f"{ENGINE}.additional_config.weight_nz_mode" if rollout.weight_nz_mode is not None else None
    nz = rollout.weight_nz_mode if nz_key else nz
    mode = "NONE (enforce_eager=True)" if rollout.enforce_eager else rollout.cudagraph_mode
    synced = rollout.free_cache_engine  # verl resumes the weights and syncs them every step
    if nz:
        checks.append(
            Check(
                "rollout.weight-nz",
                FAIL,
                f"{nz_key or NZ_VARIABLE}={nz}: vllm-ascend keeps weights in FRACTAL_NZ and its NPU worker refuses "
                "to wake up with them ('FRACTAL_NZ mode is enabled ... in the RL scenarios'), so the rollout stops "
                "at the first weight sync",
                fix=f"unset {NZ_VARIABLE} (verl sets it to 0 in vLLM's workers) or set it to 0",
            )
        )
    if fused and shape.num_experts and synced and rollout.graphs:
        checks.append(
            Check(
                "rollout.graph-mode",
                FAIL,
                f"{fused_key or FUSED_MC2_VARIABLE}={fused} with device graphs (cudagraph_mode {mode}): after every "
                "weight sync vllm-ascend's MoE process_weights_after_loading casts the experts (w13_weight, "
                "w2_weight) to FRACTAL_NZ into new storage, outside sleep mode's pool, while the graphs captured "
                "at engine start keep reading the old storage: the rollout samples with stale or freed experts. "
                "Every mode with graphs captures the MoE layers (FULL_DECODE_ONLY's decode graphs too)",
                fix=f"set {ENFORCE_EAGER}=True, or {FUSED_MC2_VARIABLE}=0 (fused MC2 serves W8A8 models only)",
            )
        )
    elif shape.num_experts and synced and not checks:
        how = (
            "no graphs are captured"
            if not rollout.graphs
            else "the graphs captured at start read the experts' storage, which process_weights_after_loading "
            "keeps (it transposes back the layout the wake-up gave them) without fused MC2"
        )
        detail = f"cudagraph_mode {mode} with weight syncs of an MoE model: {how}"
        checks.append(Check("rollout.graph-mode", OK, detail))
    return checks


def rollout_checks(
    shape: ModelShape,
    rollout: RolloutValues,
    env: Mapping[str, str],
    capacity_bytes: int,
    ranks_per_node: int,
    prompt: int,
    response: int,
    platform: str = "ascend",
) -> tuple[RolloutEstimate | None, list[Check]]:
    """The rollout's estimate and checks (none for a rollout other than vLLM: only vLLM is modelled)."""
    if rollout.name != "vllm":
        return None, [
            Check("rollout.kv-cache", WARN, f"rollout {rollout.name!r}: preflight models vLLM's KV cache only")
        ]
    result = estimate(shape, rollout, capacity_bytes, ranks_per_node, platform)
    return result, kv_cache_checks(result, rollout, shape, prompt, response) + graph_checks(
        rollout, shape, env, platform
    )
