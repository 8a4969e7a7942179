"""The shape of a decoder-only model, read from its Hugging Face config, and its parameter counts.

``ModelShape.from_hf`` takes a transformers ``PretrainedConfig``, a dict, a path (a model directory
or its ``config.json``), a model id (resolved offline only: ``local_files_only=True``), ``"glm5"``
(transformers' ``GlmMoeDsaConfig()`` defaults) or ``"glm5.2"`` (those defaults with GLM-5.2's published
differences, :data:`GLM5_2_DIFFERENCES`). Known families (llama, qwen2, qwen3, qwen3_moe,
deepseek_v3, glm_moe_dsa) get transformers' own defaults for keys the dict leaves out; any other
``model_type`` must spell out every required key and gets a ValueError naming the first one missing.

Counts follow the modules transformers instantiates for the family (checked against real tiny models
in tests_npu/test_preflight_memory.py), split the way megatron shards them: ``tp`` (split over tensor
parallel ranks), ``replicated`` (norms, router, DSA indexer, and MLA down projections, which TE builds
``duplicated``) and ``expert`` (all routed experts of the layer; megatron splits them over EP x ETP).
Multi-token-prediction layers are not modelled (transformers does not instantiate them either).
GLM-5.2's "shared" DSA layers (``indexer_types``, IndexShare) have no indexer: counted as the
published checkpoint and verl-npu's engine hold them, not as transformers 5.10.4 builds them (it
instantiates an unused indexer on every layer).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

KNOWN_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm_moe_dsa")
GLM5_NAMES, GLM5_2_NAMES = ("glm5", "glm-5"), ("glm5.2", "glm-5.2")
# GLM-5.2's published config.json (model_type glm_moe_dsa) against transformers' GlmMoeDsaConfig defaults, which
# are GLM-5's (shared/reference.md section 5); examples/glm5_2/config.json is that config.
GLM5_2_DIFFERENCES: dict[str, Any] = dict(
    indexer_types=["full" if i < 3 or (i - 2) % 4 == 0 else "shared" for i in range(78)],  # 21 full, 57 shared
    index_topk_freq=4,
    index_skip_topk_offset=3,
    index_share_for_mtp_iteration=True,
    rope_parameters={"rope_type": "default", "rope_theta": 8000000.0},
    max_position_embeddings=1048576,
    moe_router_dtype="float32",
    rope_interleave=True,
    indexer_rope_interleave=True,
    num_nextn_predict_layers=1,
    routed_scaling_factor=2.5,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
)
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


@dataclasses.dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer, by how megatron shards them."""

    tp: int  # matmul weights split over the tensor-parallel group
    replicated: int  # norms, router, DSA indexer (full layers only), MLA down projections (TE builds them duplicated)
    expert: int  # all routed experts of the layer

    @property
    def dense(self) -> int:
        return self.tp + self.replicated


@dataclasses.dataclass(frozen=True)
class ModelShape:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    gated_linear_unit: bool = True
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    proj_bias: bool = False
    mlp_bias: bool = False
    qk_layernorm: bool = False
    # MoE (num_experts == 0: dense model)
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    router_topk: int = 0
    shared_expert_ffn_hidden_size: int = 0
    is_moe: tuple[bool, ...] = ()
    # multi-latent attention (kv_lora_rank is None: standard attention)
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek sparse attention indexer (index_topk == 0: none)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # per layer: True where the DSA indexer computes its top-k ("full"), False where the layer reuses the most
    # recent full layer's ("shared": no indexer); empty = every layer full (GLM-5, DeepSeek-V3.2)
    indexer_full: tuple[bool, ...] = ()
    # the engine runs the layers through IndexShare (verl_npu.engine.index_share): every glm_moe_dsa model
    index_share: bool = False

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def dsa(self) -> bool:
        return self.index_topk > 0

    def full_indexer(self, layer: int) -> bool:
        """Whether DSA layer ``layer`` (0-based) has its own indexer (False: it reuses an earlier layer's top-k)."""
        return not self.indexer_full or self.indexer_full[layer]

    def indexer_kinds(self) -> tuple[str, ...]:
        """ "full" / "shared" per layer, as GLM-5.2's ``indexer_types`` lists them (all "full" without the list)."""
        return tuple("full" if self.full_indexer(i) else "shared" for i in range(self.num_layers))

    @property
    def shared_layers(self) -> int:
        return self.indexer_full.count(False)

    def indexer_params(self) -> int:
        """Parameters of one DSA indexer: wq_b, wk, k_norm (weight and bias) and the head-weights projection."""
        if not self.dsa:
            return 0
        h, n, d = self.hidden_size, self.index_n_heads, self.index_head_dim
        return (self.q_lora_rank or h) * n * d + h * d + 2 * d + h * n

    # --- parameter counts -----------------------------------------------------------------------
    def attention_params(self, indexer: bool = True) -> tuple[int, int]:
        """(tp-sharded, replicated) parameters of one attention block, its input norm included.

        ``indexer=False``: a shared DSA layer's, which has no indexer of its own.
        """
        h, a = self.hidden_size, self.num_attention_heads
        replicated = h  # input norm
        if not self.mla:
            d, g = self.head_dim, self.num_query_groups
            tp = h * (a + 2 * g) * d + a * d * h
            tp += (a + 2 * g) * d * self.qkv_bias + h * self.proj_bias
            replicated += 2 * d * self.qk_layernorm
            return tp, replicated
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = self.qkv_bias  # deepseek's attention_bias: q_a, kv_a and o projections
        if self.q_lora_rank:
            replicated += h * self.q_lora_rank + self.q_lora_rank * (1 + bias)  # down proj (+bias) + q norm
            tp = self.q_lora_rank * a * qk
        else:
            tp = h * a * qk
        kv = self.kv_lora_rank
        replicated += (h + bias) * (kv + self.qk_rope_head_dim) + kv  # kv down proj (+bias) + kv norm
        tp += kv * a * (self.qk_nope_head_dim + self.v_head_dim) + a * self.v_head_dim * h + h * bias
        if indexer:
            replicated += self.indexer_params()  # wq_b, wk, k_norm, weights
        return tp, replicated

    def _mlp(self, ffn: int) -> int:
        h = self.hidden_size
        return (3 if self.gated_linear_unit else 2) * h * ffn + (ffn * (1 + self.gated_linear_unit) + h) * self.mlp_bias

    def layer_params(self, layer: int) -> LayerParams:
        """Parameters of decoder layer ``layer`` (0-based), both norms included."""
        tp, replicated = self.attention_params(indexer=self.full_indexer(layer))
        replicated += self.hidden_size  # pre-MLP norm
        if self.is_moe and self.is_moe[layer]:
            replicated += self.num_experts * self.hidden_size  # router
            shared = self._mlp(self.shared_expert_ffn_hidden_size) if self.shared_expert_ffn_hidden_size else 0
            expert = self.num_experts * self._mlp(self.moe_ffn_hidden_size)
            return LayerParams(tp + shared, replicated, expert)
        return LayerParams(tp + self._mlp(self.ffn_hidden_size), replicated, 0)

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def output_params(self) -> int:
        """The output layer (lm head); 0 when tied to the embedding on a single pipeline stage."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        layers = sum(p.dense + p.expert for p in map(self.layer_params, range(self.num_layers)))
        return layers + self.embedding_params() + self.output_params() + self.hidden_size  # + final norm

    def active_params(self) -> int:
        """Parameters one token passes through (router top-k of the routed experts)."""
        total = self.total_params()
        for i in range(self.num_layers):
            expert = self.layer_params(i).expert
            total -= expert - expert * self.router_topk // max(self.num_experts, 1)
        return total

    def describe(self) -> dict[str, Any]:
        """What preflight's report says about the model (its "model" entry)."""
        described = {
            "model_type": self.model_type,
            "layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "experts": self.num_experts,
            "total_params": self.total_params(),
            "active_params": self.active_params(),
        }
        if self.dsa:
            kinds = self.indexer_kinds()
            described["dsa_indexers"] = {
                "full": [i for i, kind in enumerate(kinds) if kind == "full"],
                "shared": [i for i, kind in enumerate(kinds) if kind == "shared"],
            }
        return described

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, config: Any) -> ModelShape:
        return cls.from_dict(load_config(config))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelShape:
        cfg = dict(cfg.get("text_config") or cfg)
        model_type = str(cfg.get("model_type") or "unknown")
        for key in _REQUIRED:
            if cfg.get(key) is None:
                raise ValueError(f"model config ({model_type}) has no {key!r}; it is needed to size the model")
        h, a, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
        fields: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=h,
            num_layers=layers,
            num_attention_heads=a,
            num_query_groups=cfg.get("num_key_value_heads") or a,
            head_dim=cfg.get("head_dim") or h // a,
            ffn_hidden_size=cfg["intermediate_size"],
            # every supported family's MLP is gated (gate_proj/up_proj) whatever its activation
            gated_linear_unit=model_type in KNOWN_TYPES or bool(cfg.get("gated_linear_unit", True)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            proj_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_layernorm=model_type in ("qwen3", "qwen3_moe") or bool(cfg.get("qk_layernorm", False)),
        )
        experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        if experts:
            for key in ("moe_intermediate_size", "num_experts_per_tok"):
                if cfg.get(key) is None:
                    raise ValueError(f"model config ({model_type}) has {experts} experts but no {key!r}")
            shared = (cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"]
            fields.update(
                num_experts=experts,
                moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                router_topk=cfg["num_experts_per_tok"],
                shared_expert_ffn_hidden_size=shared or cfg.get("shared_expert_intermediate_size") or 0,
                is_moe=tuple(_moe_layers(model_type, cfg, layers)),
            )
        if cfg.get("kv_lora_rank"):
            fields.update(_mla_fields(model_type, cfg))
        return cls(**fields)


def _mla_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Multi-latent attention's fields, and the DSA indexer's (GLM-5.2's full / shared layers) when it has one."""
    layers = cfg["num_hidden_layers"]
    for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if cfg.get(key) is None:
            raise ValueError(f"model config ({model_type}) uses MLA (kv_lora_rank) but has no {key!r}")
    mla: dict[str, Any] = dict(
        num_query_groups=cfg["num_attention_heads"],  # MLA: every head has its own (decompressed) key and value
        head_dim=cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
    )
    if cfg.get("index_topk"):
        for key in ("index_n_heads", "index_head_dim"):
            if cfg.get(key) is None:
                raise ValueError(f"model config ({model_type}) has a DSA indexer but no {key!r}")
        mla.update(
            index_n_heads=cfg["index_n_heads"],
            index_head_dim=cfg["index_head_dim"],
            index_topk=cfg["index_topk"],
            index_share=model_type == "glm_moe_dsa",
        )
        kinds = cfg.get("indexer_types")
        if kinds is not None:
            if len(kinds) != layers or set(kinds) - {"full", "shared"}:
                raise ValueError(
                    f"model config ({model_type}): indexer_types must list 'full' or 'shared' for each of "
                    f"the {layers} layers"
                )
            if "shared" in kinds:
                mla["indexer_full"] = tuple(kind == "full" for kind in kinds)
    return mla


def _moe_layers(model_type: str, cfg: dict[str, Any], layers: int) -> list[bool]:
    """Which layers are MoE, by the rule the family's transformers modelling code applies."""
    if cfg.get("mlp_layer_types"):  # glm_moe_dsa
        return [kind == "sparse" for kind in cfg["mlp_layer_types"]]
    if model_type in ("qwen3_moe", "qwen2_moe") or "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:
        step, only = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
        return [i not in only and (i + 1) % step == 0 for i in range(layers)]
    first = cfg.get("first_k_dense_replace")
    first = (3 if model_type == "glm_moe_dsa" else 0) if first is None else first
    freq = cfg.get("moe_layer_freq") or 1
    return [i >= first and i % freq == 0 for i in range(layers)]


def load_config(config: Any) -> dict[str, Any]:
    """The HF config as a dict: a PretrainedConfig, a dict, a path or model dir, an offline model id, "glm5" or
    "glm5.2"."""
    if isinstance(config, dict):
        return _with_family_defaults(config)
    if hasattr(config, "to_dict"):  # a transformers PretrainedConfig: defaults already applied
        return config.to_dict()
    name = str(config)
    if name.lower() in GLM5_NAMES + GLM5_2_NAMES:
        from transformers import GlmMoeDsaConfig

        differences = copy.deepcopy(GLM5_2_DIFFERENCES) if name.lower() in GLM5_2_NAMES else {}
        return GlmMoeDsaConfig(**differences).to_dict()
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return _with_family_defaults(json.loads(path.read_text()))
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, local_files_only=True).to_dict()
    except OSError as exc:
        raise ValueError(f"{name!r}: not a config file, model directory or locally cached model id ({exc})") from exc


def _with_family_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config.json dict completed with transformers' defaults for its family (known families only)."""
    model_type = cfg.get("model_type")
    if model_type not in KNOWN_TYPES:
        return cfg
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"}).to_dict()
