"""The parity job's models and data: real architectures shrunk, weights and tokens that every platform reproduces.

Each model's config is its real one with the sizes shrunk and every other field kept:

- ``glm5_2``: GLM-5.2 as published (``examples/glm5_2/config.json``: MLA, DSA with IndexShare, sigmoid router with
  its fp32 dtype and score-correction bias, interleaved RoPE, RMSNorm eps, rules for dense/sparse and full/shared
  layers), 8 layers: full DSA layers 0, 1, 2, 6 and shared 3, 4, 5, 7 by GLM-5.2's rule; three dense layers first
  as ``first_k_dense_replace`` says. Its top-k (8) is below the sequence (48), so what each layer selects decides
  the output; 8 indexer heads, so that the ReLU'd index scores are almost never tied at 0 (with 2, a query whose
  head weights are both negative ranks tied zeros first, and CPU and CUDA break such ties differently).
- ``glm5_2_fused_shape``: the same with the dimensions Ascend's fused DSA operators take (latent 512 + 64 rope,
  32 query and 32 indexer heads of dim 128, top-k 1024, 2048-token sequences): the one MindSpeed's fused path can
  run (verl_npu/contracts/torch_npu.py holds those shape rules).
- ``dense``: Qwen2.5-0.5B (``ci/nightly/models/qwen2_5_0_5b/config.json``: GQA, QKV bias, tied embeddings).

Weights and tokens come from a counter-based generator (SplitMix64 over the tensor's name and element index), not
from a library's RNG, so CPU, CUDA and Ascend build bitwise the same checkpoint whatever their torch or
transformers versions. Weights are stored in bf16, as the published checkpoints are; an fp32 run upcasts them
exactly, so bf16 and fp32 runs differ in arithmetic only. Two kinds of tensors are scaled to make a fault visible:
attention and routing are sharpened (a wrong RoPE layout or router mapping would otherwise hardly move the
log-probs), and the indexer's key projection is scaled so that keys have a variance of the order of their
LayerNorm's eps, where the reference's eps (1e-6) and megatron-core's (1e-5) select different keys; and MLA's
query and key-value latents are drawn small enough that their RMSNorms' eps changes them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import math
from pathlib import Path
from typing import Any

from verl_npu.errors import UserError
from verl_npu.models.glm5.config import glm5_2_indexer_types
from verl_npu.models.glm5.family import published_glm5_2_config

REPO_ROOT = Path(__file__).resolve().parents[2]
QWEN2_5_CONFIG = REPO_ROOT / "ci" / "nightly" / "models" / "qwen2_5_0_5b" / "config.json"


class ParityModelError(UserError):
    """A parity model whose published config is not where it is read from."""


@dataclasses.dataclass(frozen=True)
class ParityModel:
    """One parity model: its real config shrunk (read when first used), the data it runs on, the path it exercises."""

    name: str
    # "glm5_2" (GLM-5.2's published config, verl_npu/models/glm5/family.py) or "qwen2_5"
    # (ci/nightly/models/qwen2_5_0_5b/config.json)
    family: str
    sizes: tuple[tuple[str, Any], ...]
    seq_len: int
    batch: int  # sequences per step and in the evaluation batch
    micro_batches: int  # the batch is split in this many (a top-k must not leak between them)
    fused_dsa: bool = False  # its shapes are the ones Ascend's fused DSA operators take
    # its block-boundary tensors are recorded and replayed (verl_npu/parity/replay.py); off where they would not
    # fit a reference of a few MiB (2048-token sequences: tens of MiB per dtype)
    replay: bool = True

    def __post_init__(self) -> None:
        if self.family not in _FAMILIES:  # a misspelt family must not build another architecture
            raise ValueError(f"parity model {self.name}: family {self.family!r}, expected one of {sorted(_FAMILIES)}")

    @property
    def config(self) -> dict[str, Any]:
        return copy.deepcopy(_config(self.family, self.sizes))

    @property
    def dsa(self) -> bool:
        return bool(_config(self.family, self.sizes).get("index_topk"))


def _published(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ParityModelError(f"{path}: the parity models read their published config there ({exc}); run verl-npu "
                               "from its checkout (an editable install, as the images have)") from None  # fmt: skip


@functools.cache
def _config(family: str, sizes: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    return _FAMILIES[family](**dict(sizes))


def _glm5_2_layers(layers: int) -> dict[str, Any]:
    """GLM-5.2's per-layer rules applied to ``layers`` layers (docs/upstream_facts.md)."""
    full = glm5_2_indexer_types(layers)
    dense = 3  # first_k_dense_replace, as published
    return dict(
        num_hidden_layers=layers,
        indexer_types=full,
        mlp_layer_types=["dense" if i < dense else "sparse" for i in range(layers)],
        first_k_dense_replace=dense,
    )


def _glm5_2(num_hidden_layers: int = 8, **sizes: Any) -> dict[str, Any]:
    published = published_glm5_2_config()
    config = {**published, **_glm5_2_layers(num_hidden_layers), **sizes}
    config.pop("torch_dtype", None)
    config["qk_head_dim"] = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    return config


def _qwen2_5(**sizes: Any) -> dict[str, Any]:
    published = _published(QWEN2_5_CONFIG)
    keep = {k: v for k, v in published.items() if k not in ("_name_or_path", "id2label", "label2id", "dtype")}
    config = {**keep, **sizes}
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    config["max_window_layers"] = config["num_hidden_layers"]
    return config


_FAMILIES = {"glm5_2": _glm5_2, "qwen2_5": _qwen2_5}  # family -> the builder of its shrunk config


def _sizes(**sizes: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(sizes.items()))


MODELS: dict[str, ParityModel] = {
    "glm5_2": ParityModel(
        "glm5_2",
        "glm5_2",
        _sizes(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=8, index_head_dim=16,
            index_topk=8, max_position_embeddings=256,
        ),
        seq_len=48, batch=4, micro_batches=2,
    ),
    "glm5_2_fused_shape": ParityModel(
        "glm5_2_fused_shape",
        "glm5_2",
        _sizes(
            vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
            num_attention_heads=32, num_key_value_heads=32, n_routed_experts=4, num_experts_per_tok=2,
            q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
            index_n_heads=32, index_head_dim=128, index_topk=1024, max_position_embeddings=4096,
        ),
        seq_len=2048, batch=2, micro_batches=2, fused_dsa=True, replay=False,
    ),
    "dense": ParityModel(
        "dense",
        "qwen2_5",
        _sizes(
            vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256,
        ),
        seq_len=48, batch=4, micro_batches=2,
    ),
}  # fmt: skip
DEFAULT_MODELS = ("glm5_2", "dense")  # what `verl-npu parity run` runs unless told (any platform, in seconds)


# --- the counter-based generator ------------------------------------------------------------------------------------
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's constants


def uniform(name: str, count: int) -> Any:
    """``count`` float64 values in [-1, 1) for ``name``: SplitMix64 of (seed(name) + index), identical everywhere
    (numpy's uint64 arithmetic wraps modulo 2**64, as SplitMix64 is defined)."""
    import numpy as np

    seed = np.uint64(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))
    with np.errstate(over="ignore"):
        x = (np.arange(count, dtype=np.uint64) + seed) * np.uint64(_GOLDEN)
        x ^= x >> np.uint64(30)
        x *= np.uint64(_MIX1)
        x ^= x >> np.uint64(27)
        x *= np.uint64(_MIX2)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * (2.0**-52) - 1.0


def tokens(name: str, shape: tuple[int, ...], vocab: int) -> Any:
    """Token ids in [0, vocab) for ``name`` (the evaluation batch, a training step's batch)."""
    import numpy as np

    count = math.prod(shape)
    return np.minimum(((uniform(name, count) + 1.0) * 0.5 * vocab).astype(np.int64), vocab - 1).reshape(shape)


# --- the checkpoint -------------------------------------------------------------------------------------------------
def _glm5_2_tensors(c: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of a published-layout GLM-5.2 checkpoint (HF names, as vLLM and the bridge read them) and its
    kind (the scale it is drawn with); shared layers ship no indexer, and there is no MTP layer."""
    h, heads, q_lora, kv_lora = c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((c["vocab_size"], h), "embedding"),
        "model.norm.weight": ((h,), "norm"),
        "lm_head.weight": ((c["vocab_size"], h), "linear"),
    }
    moe, experts, shared = c["moe_intermediate_size"], c["n_routed_experts"], c["n_shared_experts"]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": ((h,), "norm"),
            p + "post_attention_layernorm.weight": ((h,), "norm"),
            p + "self_attn.q_a_proj.weight": ((q_lora, h), "latent"),
            p + "self_attn.q_a_layernorm.weight": ((q_lora,), "norm"),
            p + "self_attn.q_b_proj.weight": ((heads * (nope + rope), q_lora), "sharp"),
            p + "self_attn.kv_a_proj_with_mqa.weight": ((kv_lora + rope, h), f"latent_rows:{kv_lora}"),
            p + "self_attn.kv_a_layernorm.weight": ((kv_lora,), "norm"),
            p + "self_attn.kv_b_proj.weight": ((heads * (nope + v), kv_lora), "linear"),
            p + "self_attn.o_proj.weight": ((h, heads * v), "linear"),
        }
        if c["indexer_types"][i] == "full":
            dim, n = c["index_head_dim"], c["index_n_heads"]
            out |= {
                p + "self_attn.indexer.wq_b.weight": ((n * dim, q_lora), "sharp"),
                p + "self_attn.indexer.wk.weight": ((dim, h), "indexer_key"),
                p + "self_attn.indexer.k_norm.weight": ((dim,), "norm"),
                p + "self_attn.indexer.k_norm.bias": ((dim,), "bias"),
                p + "self_attn.indexer.weights_proj.weight": ((n, h), "linear"),
            }
        if c["mlp_layer_types"][i] == "dense":
            inter = c["intermediate_size"]
            out |= {p + f"mlp.{k}_proj.weight": (s, "linear") for k, s in _mlp(h, inter).items()}
            continue
        out |= {
            p + "mlp.gate.weight": ((experts, h), "sharp"),
            p + "mlp.gate.e_score_correction_bias": ((experts,), "bias"),
        }
        for e in range(experts):
            out |= {p + f"mlp.experts.{e}.{k}_proj.weight": (s, "linear") for k, s in _mlp(h, moe).items()}
        out |= {p + f"mlp.shared_experts.{k}_proj.weight": (s, "linear") for k, s in _mlp(h, moe * shared).items()}
    return out


def _mlp(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}


def _qwen2_tensors(c: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    dim = h // heads
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((c["vocab_size"], h), "embedding"),
        "model.norm.weight": ((h,), "norm"),
    }
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = ((c["vocab_size"], h), "linear")
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": ((h,), "norm"),
            p + "post_attention_layernorm.weight": ((h,), "norm"),
            p + "self_attn.q_proj.weight": ((heads * dim, h), "sharp"),
            p + "self_attn.q_proj.bias": ((heads * dim,), "bias"),
            p + "self_attn.k_proj.weight": ((kv * dim, h), "sharp"),
            p + "self_attn.k_proj.bias": ((kv * dim,), "bias"),
            p + "self_attn.v_proj.weight": ((kv * dim, h), "linear"),
            p + "self_attn.v_proj.bias": ((kv * dim,), "bias"),
            p + "self_attn.o_proj.weight": ((h, heads * dim), "linear"),
        }
        out |= {p + f"mlp.{k}_proj.weight": (s, "linear") for k, s in _mlp(h, c["intermediate_size"]).items()}
    return out


def checkpoint_tensors(model: ParityModel) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF tensor name -> (shape, kind) of the model's checkpoint."""
    if model.config["model_type"] == "glm_moe_dsa":
        return _glm5_2_tensors(model.config)
    return _qwen2_tensors(model.config)


# MLA's q and kv latents (before their RMSNorms) drawn with a variance of ~1e-5, the order of the norms' eps: the
# eps the engine gives them (the config's rms_norm_eps, as vLLM's rollout: docs/parity.md) then decides their scale
LATENT_SCALE = 3e-3


def _values(name: str, shape: tuple[int, ...], kind: str) -> Any:
    u = uniform(name, math.prod(shape)).reshape(shape)
    fan_in = shape[-1] if len(shape) > 1 else 1
    if kind == "norm":
        return 1.0 + 0.25 * u
    if kind == "bias":
        return 0.1 * u
    if kind == "embedding":
        return u
    scale = math.sqrt(3.0 / fan_in)  # uniform with unit output variance on unit inputs
    if kind == "sharp":
        return 3.0 * scale * u
    if kind == "indexer_key":
        # keys of variance ~3e-6 over the head dim: the order of the key norm's eps (module docstring)
        return 2e-3 * scale * u
    if kind == "latent":
        return LATENT_SCALE * scale * u
    if kind.startswith("latent_rows:"):
        # MLA's kv_a projection: its first rows make the normed latent, the rest the RoPE key, kept sharp (a
        # small RoPE key would hide a wrong RoPE layout)
        rows = int(kind.partition(":")[2])
        values = 3.0 * scale * u
        values[:rows] *= LATENT_SCALE / 3.0
        return values
    return scale * u


def write_checkpoint(model: ParityModel, path: str | Path) -> Path:
    """The model's config.json and model.safetensors (bf16; the router's score-correction bias fp32) in ``path``."""
    import torch
    from safetensors.torch import save_file

    from verl_npu import atomic

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (shape, kind) in checkpoint_tensors(model).items():
        dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        tensors[name] = torch.from_numpy(_values(name, shape, kind)).to(dtype).contiguous()
    atomic.write_with(
        path / "model.safetensors", lambda temporary: save_file(tensors, str(temporary), {"format": "pt"})
    )
    atomic.write_text(path / "config.json", json.dumps(model.config, indent=2, sort_keys=True) + "\n")
    return path


def evaluation_tokens(model: ParityModel) -> Any:
    return tokens(f"{model.name}/eval", (model.batch, model.seq_len), model.config["vocab_size"])


def training_tokens(model: ParityModel, step: int) -> Any:
    return tokens(f"{model.name}/train/{step}", (model.batch, model.seq_len), model.config["vocab_size"])


def advantages(model: ParityModel, step: int) -> Any:
    """Per-token advantages in [-1, 1) of a training step (the policy-gradient loss weights)."""
    return uniform(f"{model.name}/advantages/{step}", model.batch * model.seq_len).reshape(model.batch, model.seq_len)
