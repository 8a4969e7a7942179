"""The shape of a decoder-only model, read from its Hugging Face config, and its parameter counts.

``ModelShape.from_hf`` takes a transformers ``PretrainedConfig``, a dict, a path (a model directory or its
``config.json``), a model id (resolved offline only: ``local_files_only=True``), or a name a registered model family
knows (verl_npu.models: ``"glm5"`` is transformers' ``GlmMoeDsaConfig()`` defaults, ``"glm5.2"`` GLM-5.2's published
config). Known families (llama, qwen2, qwen3, qwen3_moe, deepseek_v3, and every registered one) get their defaults for
keys the dict leaves out; any other ``model_type`` must spell out every required key. Every value is read through
verl_npu.inputs (:data:`SIZES`): a value that is missing, of the wrong type or out of range is an InputErrors (a
ValueError) naming each one, and a config.json is checked before transformers builds its family's config class from
it (:func:`check_values`).

Counts follow the modules transformers instantiates for the family (checked against real tiny models
in tests_npu/preflight/test_preflight_memory.py), split the way megatron shards them: ``tp`` (split over tensor
parallel ranks), ``replicated`` (norms, router, DSA indexer, and MLA down projections, which TE builds
``duplicated``) and ``expert`` (all routed experts of the layer; megatron splits them over EP x ETP).
Multi-token-prediction layers are not modelled (transformers does not instantiate them either).
A DSA family's "shared" layers (GLM-5.2's ``indexer_types``, IndexShare) have no indexer: counted as the
published checkpoint and verl-npu's engine hold them, not as transformers 5.10.4 builds them (it
instantiates an unused indexer on every layer).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from verl_npu import inputs
from verl_npu.bounded_read import MIB, NotReadable, expand_user, read_text
from verl_npu.errors import UserError
from verl_npu.inputs import MAX_EXPERTS, MAX_HEADS, MAX_HIDDEN, MAX_LAYERS, MAX_TOKENS, MAX_VOCAB, InputError
from verl_npu.models import family as model_family
from verl_npu.preflight.values import InputErrors, Reader

MAX_CONFIG_BYTES = 16 * MIB  # a model's config.json
MAX_POSITIONS = 1 << 40  # max_position_embeddings: a declared limit, not a sequence preflight builds

# the families whose defaults come from transformers' own config class; a registered family (verl_npu.models)
# completes its own
KNOWN_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")


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
    # the engine runs the layers through IndexShare (verl_npu.engine.index_share): every model of a registered DSA
    # family (verl_npu.models)
    index_share: bool = False
    # the longest sequence the config declares (None: it declares none); verl's rollout passes it to vLLM as
    # max_model_len when actor_rollout_ref.rollout.max_model_len is unset (verl_npu.preflight.rollout)
    max_position_embeddings: int | None = None

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
        kv = self.kv_lora_rank or 0  # never None here: self.mla
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
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelShape:
        """The shape of an HF config dict, every value read through verl_npu.inputs (:data:`SIZES`).

        Raises :class:`verl_npu.preflight.values.InputErrors` naming every value that is missing, of the wrong type
        or out of range (a ``UserError``, so a ``ValueError``).
        """
        cfg = _text_config(cfg)
        declared = cfg.get("model_type")
        model_type = declared if isinstance(declared, str) else "unknown"
        r = Reader(cfg, source=f"model config ({model_type[:64]})")
        r.text("model_type", default="unknown", max_length=256)
        _read_every_value(r)  # every size the config sets, whether or not this model uses it

        def size(key: str, default: Any = _MISSING) -> Any:
            return r.integer(key, *SIZES[key], **({} if default is _MISSING else {"default": default}))

        h, a, layers = size("hidden_size"), size("num_attention_heads"), size("num_hidden_layers")
        head_dim = size("head_dim", None)
        if head_dim is None and h and a:
            r.rule(h // a >= 1, "hidden_size // num_attention_heads", h // a,
                   "at least 1 (more attention heads than hidden channels: set head_dim)")  # fmt: skip
            head_dim = h // a
        flag = lambda key, default: r.boolean(key, default=default)  # noqa: E731
        bias = flag("attention_bias", None)
        fields: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=size("vocab_size"),
            hidden_size=h,
            num_layers=layers,
            num_attention_heads=a,
            num_query_groups=size("num_key_value_heads", None) or a,
            head_dim=head_dim,
            ffn_hidden_size=size("intermediate_size"),
            # every supported family's MLP is gated (gate_proj/up_proj) whatever its activation
            gated_linear_unit=model_type in KNOWN_TYPES or flag("gated_linear_unit", True),
            tie_word_embeddings=flag("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" if bias is None else bias,
            proj_bias=bool(bias),
            mlp_bias=flag("mlp_bias", False),
            qk_layernorm=model_type in ("qwen3", "qwen3_moe") or flag("qk_layernorm", False),
            max_position_embeddings=size("max_position_embeddings", None),
        )
        counts = [size(key, None) for key in EXPERT_COUNT_KEYS]  # the first one set counts, as transformers reads them
        experts = next((n for n in counts if n), 0)
        if experts:
            moe, topk = size("moe_intermediate_size"), size("num_experts_per_tok")
            r.rule(
                moe is None or moe >= 1, "moe_intermediate_size", moe, f"at least 1 in a model with {experts} experts"
            )
            r.rule(topk is None or 1 <= topk <= experts, "num_experts_per_tok", topk,
                   f"from 1 to the model's {experts} routed experts")  # fmt: skip
            shared = (size("n_shared_experts", 0) or 0) * (moe or 0)
            fields.update(
                num_experts=experts,
                moe_ffn_hidden_size=moe,
                router_topk=topk,
                shared_expert_ffn_hidden_size=shared or size("shared_expert_intermediate_size", 0) or 0,
                is_moe=_moe_layers(model_type, r, cfg, layers),
            )
        if size("kv_lora_rank", None):
            fields.update(_mla_fields(r, a, layers))
        r.raise_errors()  # nothing was computed with a bad value; the shape is built from good ones only
        return cls(**fields)


_MISSING: Any = object()
# The bounds of every size ModelShape reads from an HF config (verl_npu.inputs' limits). The minimum is 0 for the
# sizes of optional parts (experts, MLA, the DSA indexer): from_dict requires more where the model has the part.
SIZES: dict[str, tuple[int, int]] = {
    "vocab_size": (1, MAX_VOCAB),
    "hidden_size": (1, MAX_HIDDEN),
    "num_hidden_layers": (1, MAX_LAYERS),
    "num_attention_heads": (1, MAX_HEADS),
    "num_key_value_heads": (1, MAX_HEADS),
    "head_dim": (1, MAX_HIDDEN),
    "intermediate_size": (1, MAX_HIDDEN),
    "n_routed_experts": (0, MAX_EXPERTS),
    "num_experts": (0, MAX_EXPERTS),
    "num_local_experts": (0, MAX_EXPERTS),
    "moe_intermediate_size": (0, MAX_HIDDEN),
    "num_experts_per_tok": (0, MAX_EXPERTS),
    "n_shared_experts": (0, MAX_EXPERTS),
    "shared_expert_intermediate_size": (0, MAX_HIDDEN),
    "first_k_dense_replace": (0, MAX_LAYERS),
    "moe_layer_freq": (1, MAX_LAYERS),
    "decoder_sparse_step": (1, MAX_LAYERS),
    "q_lora_rank": (0, MAX_HIDDEN),
    "kv_lora_rank": (0, MAX_HIDDEN),
    "qk_nope_head_dim": (0, MAX_HIDDEN),
    "qk_rope_head_dim": (0, MAX_HIDDEN),
    "v_head_dim": (0, MAX_HIDDEN),
    "index_topk": (0, MAX_TOKENS),
    "index_n_heads": (0, MAX_HEADS),
    "index_head_dim": (0, MAX_HIDDEN),
    "max_position_embeddings": (1, MAX_POSITIONS),
}
BOOLEANS = ("gated_linear_unit", "tie_word_embeddings", "attention_bias", "mlp_bias", "qk_layernorm")
LAYER_LISTS = ("mlp_layer_types", "indexer_types", "layer_types", "mlp_only_layers")  # at most one entry a layer
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


class ModelConfigError(UserError):
    """A model config that is there but cannot be read as one (not JSON, not a mapping, refused by transformers)."""


def _text_config(cfg: Any, source: str | None = None) -> Mapping[str, Any]:
    """The decoder's config: ``text_config`` of a multimodal config, else the config itself (both mappings)."""
    cfg = inputs.mapping("model config", cfg, source=source)
    inner = cfg.get("text_config")
    return inputs.mapping("text_config", inner, source=source) if inner else cfg


def check_values(cfg: Any, source: str | None = None) -> None:
    """Every size, switch and per-layer list the config sets is in range (:data:`SIZES`), before anything loops over it.

    Runs before transformers builds the family's config class from the dict: its constructors loop over
    ``num_hidden_layers`` (a config of 10**9 layers would never return). Raises InputErrors naming every bad value.
    """
    configs = [inputs.mapping("model config", cfg, source=source)]
    if configs[0].get("text_config"):
        configs.append(_text_config(cfg, source))
    errors = []
    for config in configs:
        r = Reader(config, source=source or "model config")
        _read_every_value(r)
        errors += r.errors
    if errors:
        raise InputErrors(errors)


def _read_every_value(r: Reader) -> None:
    for key, (minimum, maximum) in SIZES.items():
        r.integer(key, minimum, maximum, default=None)
    for key in BOOLEANS:
        r.boolean(key, default=None)
    for key in LAYER_LISTS:
        r.value(key, _layer_list, default=None)


def _layer_list(key: str, value: Any) -> list[Any]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or len(value) > MAX_LAYERS:
        raise InputError(key, value, f"a list of at most {MAX_LAYERS} entries (one a layer)")
    return list(value)


def _per_layer(r: Reader, key: str, layers: int | None, kinds: tuple[str, ...]) -> list[str] | None:
    """A list of one of ``kinds`` per layer (``mlp_layer_types``, ``indexer_types``), or None when unset or bad."""

    def parse(name: str, value: Any) -> list[str]:
        allowed = f"a list of {' or '.join(map(repr, kinds))}, one for each of the {layers} layers"
        if isinstance(value, str | bytes) or not isinstance(value, Sequence) or len(value) != layers:
            raise InputError(name, value, allowed, source=r.source)
        if any(not isinstance(kind, str) or kind not in kinds for kind in value):
            raise InputError(name, value, allowed, source=r.source)
        return list(value)

    return r.value(key, parse, default=None) if layers else None


def _mla_fields(r: Reader, heads: int | None, layers: int | None) -> dict[str, Any]:
    """Multi-latent attention's fields, and the DSA indexer's (GLM-5.2's full / shared layers) when it has one."""

    def size(key: str, default: Any = _MISSING) -> Any:
        return r.integer(key, *SIZES[key], **({} if default is _MISSING else {"default": default}))

    nope, rope, v = size("qk_nope_head_dim"), size("qk_rope_head_dim"), size("v_head_dim")
    if nope is not None and rope is not None:
        r.rule(nope + rope >= 1, "qk_nope_head_dim + qk_rope_head_dim", nope + rope, "at least 1 (a query-key head)")
    r.rule(v is None or v >= 1, "v_head_dim", v, "at least 1 with MLA (kv_lora_rank)")
    mla: dict[str, Any] = dict(
        num_query_groups=heads,  # MLA: every head has its own (decompressed) key and value
        head_dim=(nope or 0) + (rope or 0),
        q_lora_rank=size("q_lora_rank", None),
        kv_lora_rank=size("kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
    )
    if size("index_topk", None):
        heads, dim = size("index_n_heads"), size("index_head_dim")
        r.rule(heads is None or heads >= 1, "index_n_heads", heads, "at least 1 with a DSA indexer (index_topk)")
        r.rule(dim is None or dim >= 1, "index_head_dim", dim, "at least 1 with a DSA indexer (index_topk)")
        family = model_family.family_of(r.root.get("model_type"))
        mla.update(index_n_heads=heads, index_head_dim=dim, index_topk=size("index_topk"),
                   index_share=family is not None)  # fmt: skip
        kinds = _per_layer(r, "indexer_types", layers, (model_family.FULL, model_family.SHARED))
        if family is not None and layers and not r.errors:
            kinds = _family_layer_kinds(r.root, family) or kinds
        if kinds is not None and model_family.SHARED in kinds:
            mla["indexer_full"] = tuple(kind == model_family.FULL for kind in kinds)
    return mla


def _family_layer_kinds(cfg: Mapping[str, Any], family: model_family.ModelFamily) -> list[str] | None:
    """The family's own rule for which DSA layers are full. A layout it refuses counts as listed here: the engine
    check (verl_npu.preflight.engine_checks, ``engine.model-bridge``) fails it with the family's reason."""
    try:
        return list(family.indexer_kinds(model_family.as_attributes(cfg)))
    except (ValueError, TypeError, AttributeError):
        return None


def _moe_layers(model_type: str, r: Reader, cfg: Mapping[str, Any], layers: int | None) -> tuple[bool, ...]:
    """Which layers are MoE, by the rule the family's transformers modelling code applies."""
    if not layers:
        return ()
    if cfg.get("mlp_layer_types"):  # glm_moe_dsa
        kinds = _per_layer(r, "mlp_layer_types", layers, ("dense", "sparse"))
        return tuple(kind == "sparse" for kind in kinds or ())
    if model_type in ("qwen3_moe", "qwen2_moe") or "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:
        step = r.integer("decoder_sparse_step", *SIZES["decoder_sparse_step"], default=1)

        def indices(key: str, value: Any) -> set[int]:
            allowed = f"a list of layer numbers from 0 to {layers - 1}"
            if isinstance(value, str | bytes) or not isinstance(value, Sequence) or len(value) > MAX_LAYERS:
                raise InputError(key, value, allowed, source=r.source)
            return {inputs.integer(key, i, minimum=0, maximum=layers - 1, source=r.source) for i in value}

        only = r.value("mlp_only_layers", indices, default=set())
        return tuple(i not in (only or ()) and (i + 1) % (step or 1) == 0 for i in range(layers))
    family = model_family.family_of(model_type)
    first = r.integer("first_k_dense_replace", *SIZES["first_k_dense_replace"],
                      default=family.first_dense_layers if family else 0)  # fmt: skip
    freq = r.integer("moe_layer_freq", *SIZES["moe_layer_freq"], default=1)
    return tuple(i >= (first or 0) and i % (freq or 1) == 0 for i in range(layers))


def load_config(config: Any) -> dict[str, Any]:
    """The HF config as a dict: a PretrainedConfig, a dict, a path or model dir, an offline model id, or a name a
    registered model family knows ("glm5", "glm5.2").

    Raises ModelConfigError or InputErrors (UserErrors) for a config that is there but unusable (not JSON, values out
    of range, refused by transformers), and a plain ValueError when there is no such file, directory or cached id.
    """
    if isinstance(config, dict):
        check_values(config)
        return _with_family_defaults(config)
    if hasattr(config, "to_dict"):  # a transformers PretrainedConfig: defaults already applied
        return config.to_dict()
    name = str(config)
    named = model_family.named_as(name)  # "glm5", "glm-5.2", "glm5_2", ...
    if named is not None:
        family, variant = named
        return family.variant_config(variant)
    try:
        path = expand_user(name)
    except NotReadable as exc:
        raise ModelConfigError(str(exc)) from None
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(read_text(path, MAX_CONFIG_BYTES))
        except NotReadable as exc:
            raise ModelConfigError(f"{path}: cannot read the model config ({exc})") from None
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, integers of more than 4300 digits
            raise ModelConfigError(f"{path}: not a JSON model config ({exc})") from None
        check_values(cfg, source=str(path))
        return _with_family_defaults(cfg, source=str(path))
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, local_files_only=True).to_dict()
    except OSError as exc:
        raise ValueError(f"{name!r}: not a config file, model directory or locally cached model id ({exc})") from exc
    except _refusals() as exc:  # a cached model whose config its family's class refuses
        raise _refused("cached", exc, name) from None


def _with_family_defaults(cfg: dict[str, Any], source: str | None = None) -> dict[str, Any]:
    """A config.json dict completed with transformers' defaults for its family (known families only)."""
    model_type = cfg.get("model_type")
    family = model_family.family_of(model_type)
    if model_type not in KNOWN_TYPES and family is None:
        return cfg
    try:
        if family is not None:
            return family.complete(cfg)
        from transformers import AutoConfig

        return AutoConfig.for_model(str(model_type), **{k: v for k, v in cfg.items() if k != "model_type"}).to_dict()
    except _refusals() as exc:  # transformers' own validation of the family's fields
        raise _refused(model_type, exc, source) from None


def _refusals() -> tuple[type[Exception], ...]:
    """What transformers raises for a config its family's class refuses (huggingface_hub's strict dataclasses)."""
    from huggingface_hub.errors import StrictDataclassError

    return TypeError, ValueError, StrictDataclassError


def _refused(model_type: Any, exc: Exception, source: str | None) -> ModelConfigError:
    where = f"{source}: " if source else ""
    text = " ".join(str(exc).split())
    return ModelConfigError(f"{where}transformers' {model_type} config refuses it: {text[:500]}")
