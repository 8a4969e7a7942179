"""A tiny GLM-5.2 checkpoint laid out like the published one, for the bridge and engine tests.

transformers 5.10.4's GlmMoeDsa implements GLM-5.2's shared DSA layers but still builds (and
``save_pretrained`` writes) an indexer on every layer, and it has no MTP layer. GLM-5.2's published
checkpoint differs (docs/upstream_facts.md): shared layers ship no ``self_attn.indexer.*``
tensors, the MTP layer is checkpoint layer ``num_hidden_layers``, the shards come with
``model.safetensors.index.json``, and the FP8 release stores linear weights as e4m3 with one float32
scale per 128x128 block (``<weight>_scale_inv``, DeepSeek-V3's format, with its ``quantization_config``).
:func:`tiny_glm5_2_checkpoint` saves a tiny model with transformers and rewrites its tensors that way.

The tiny config keeps GLM-5.2's layer kinds (``indexer_types`` from ``index_topk_freq`` 4 and
``index_skip_topk_offset`` 3: full layers 0, 1, 2 and 6), router, RoPE theta and MTP count; dense
layers come first by both ``mlp_layer_types`` (transformers, the bridge) and ``first_k_dense_replace``
(vLLM). RoPE is half-split (``rope_interleave`` / ``indexer_rope_interleave`` false), which is what
transformers computes whatever the flags say, so the HF model is a reference for the engine's log-probs;
``index_topk`` 32 keeps every key of a 32-token sequence.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

LAYERS = 8
INDEXER_TYPES = ["full", "full", "full", "shared", "shared", "shared", "full", "shared"]
TINY_GLM5_2: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    mlp_layer_types=["dense"] + ["sparse"] * (LAYERS - 1), first_k_dense_replace=1,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    index_n_heads=2, index_head_dim=16, index_topk=32, indexer_types=INDEXER_TYPES, index_topk_freq=4,
    index_skip_topk_offset=3, index_share_for_mtp_iteration=True, num_nextn_predict_layers=1,
    rope_parameters={"rope_type": "default", "rope_theta": 8000000.0}, max_position_embeddings=128,
    rope_interleave=False, indexer_rope_interleave=False, moe_router_dtype="float32", topk_method="noaux_tc",
    scoring_func="sigmoid", routed_scaling_factor=2.5, norm_topk_prob=True, n_group=1, topk_group=1,
    tie_word_embeddings=False,
)  # fmt: skip

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
# DeepSeek-V3's FP8 config entry (GLM-5.x's FP8 releases use the same format).
FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}
# The linear weights an FP8 release quantises: attention and indexer projections, dense MLPs and experts.
# Norms, the router (and its bias), indexer.weights_proj (transformers keeps it a plain Linear for that
# reason), embeddings and the LM head stay in bf16.
_FP8_WEIGHT = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.wq_b|indexer\.wk)"
    r"|mlp\.(gate_proj|up_proj|down_proj|shared_experts\.\w+|experts\.\d+\.\w+))\.weight"
)
_MTP_ONLY = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def is_fp8_weight(name: str) -> bool:
    return _FP8_WEIGHT.fullmatch(name) is not None


def shared_indexer_prefixes(config: Any) -> tuple[str, ...]:
    """``model.layers.<i>.self_attn.indexer.`` of every shared layer (no such tensors in the published checkpoint)."""
    return tuple(
        f"model.layers.{i}.self_attn.indexer." for i, kind in enumerate(config.indexer_types) if kind == "shared"
    )


def mtp_prefixes(config: Any) -> tuple[str, ...]:
    first = config.num_hidden_layers
    return tuple(f"model.layers.{first + i}." for i in range(getattr(config, "num_nextn_predict_layers", 0) or 0))


def quantize_fp8_blocks(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale per block) with ``weight ~= e4m3 * scale`` blockwise (DeepSeek-V3's recipe)."""
    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // block) * block, -(-cols // block) * block, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [row blocks, block, col blocks, block]
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    quantized = (blocks / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:rows, :cols]
    return quantized.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def dequantize_fp8_blocks(quantized: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """The reference dequantisation: e4m3 value times its block's scale, in float32, rounded to bf16."""
    rows, cols = quantized.shape
    per_element = scale.repeat_interleave(block, dim=0)[:rows].repeat_interleave(block, dim=1)[:, :cols]
    return (quantized.float() * per_element).to(torch.bfloat16)


def sharpened_model(config: Any, seed: int) -> torch.nn.Module:
    """A seeded GlmMoeDsaForCausalLM whose weights make a wrong mapping visible in the log-probs."""
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # norms (and the indexer key norm's bias) a wrong mapping would show
                param.uniform_(0.5, 1.5)
            if name.endswith(("q_b_proj.weight", "kv_a_proj_with_mqa.weight", "mlp.gate.weight")):
                # sharper attention and routing: with the default init both are near uniform, and a wrong
                # RoPE layout or router mapping would hardly change the log-probs
                param.mul_(10)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.1, 0.1)
    return model


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t1").save_pretrained(path)


def _write_shards(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    from safetensors.torch import save_file

    for old in path.glob("model*.safetensors*"):
        old.unlink()
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(path / "model.safetensors"), {"format": "pt"})
        return
    weight_map = {}
    for shard in range(shards):
        filename = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = names[shard::shards]
        save_file({n: tensors[n].contiguous() for n in part}, str(path / filename), {"format": "pt"})
        weight_map.update(dict.fromkeys(part, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def tiny_glm5_2_checkpoint(path: Path, fp8: bool = False, *, shards: int = 2, seed: int = 0, **overrides: Any):
    """Write a published-style tiny GLM-5.2 (weights, config, tokenizer) into ``path``; returns (path, HF config).

    ``fp8``: the FP8 release's layout (e4m3 weights with 128x128 block scales and ``quantization_config``);
    the same seed gives the same bf16 weights before quantisation. ``shards`` > 1 writes an index file;
    ``overrides`` change TINY_GLM5_2's fields.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, GlmMoeDsaConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = GlmMoeDsaConfig(**{**TINY_GLM5_2, **overrides})
    sharpened_model(config, seed).save_pretrained(path)
    _write_tokenizer(path, config.vocab_size)
    saved = {}
    for file in sorted(path.glob("*.safetensors")):
        saved.update(load_file(str(file)))
    # published dtypes: bf16, the router's score-correction bias in fp32 (transformers keeps it so)
    for name, tensor in saved.items():
        if tensor.is_floating_point() and not name.endswith("e_score_correction_bias"):
            saved[name] = tensor.to(torch.bfloat16)

    # MTP layer(s): a full decoder layer (with an indexer: MTP layers keep theirs) plus the MTP-only tensors
    last = config.num_hidden_layers - 1
    generator = torch.Generator().manual_seed(seed + 1)
    for mtp in mtp_prefixes(config):
        donor = {n: t for n, t in saved.items() if n.startswith(f"model.layers.{last}.")}
        for name, tensor in donor.items():
            saved[mtp + name.removeprefix(f"model.layers.{last}.")] = tensor.clone()
        for suffix in ("self_attn.indexer.wq_b.weight", "self_attn.indexer.wk.weight"):
            saved.setdefault(mtp + suffix, saved[f"model.layers.0.{suffix}"].clone())
        hidden = config.hidden_size
        for suffix in _MTP_ONLY:
            shape = (hidden, 2 * hidden) if suffix == "eh_proj.weight" else (hidden,)
            saved[mtp + suffix] = (torch.rand(shape, generator=generator) + 0.5).to(torch.bfloat16)
    # the published checkpoint has no indexer tensors on shared layers
    for prefix in shared_indexer_prefixes(config):
        for name in [n for n in saved if n.startswith(prefix)]:
            del saved[name]
    if fp8:
        for name in [n for n in saved if is_fp8_weight(n)]:
            saved[name], saved[name + SCALE_SUFFIX] = quantize_fp8_blocks(saved[name])
    _write_shards(path, saved, shards)

    written = json.loads((path / "config.json").read_text())
    # GLM-5.2's published fields transformers does not write back on its own
    written.update({k: v for k, v in TINY_GLM5_2.items() if k not in written}, **overrides)
    if fp8:
        written["quantization_config"] = FP8_QUANTIZATION_CONFIG
    (path / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    return path, AutoConfig.from_pretrained(path)
