"""The two models bench/rl_step.py measures, written as random-weight HF checkpoints (issue 31, item 2).

- ``dense``: Qwen2.5-1.5B's dimensions (hidden 1536, 28 layers, 12 heads with 2 KV heads, intermediate 8960,
  vocabulary 151936, tied embeddings; every other field from ci/nightly/models/qwen2_5_0_5b/config.json), about
  1.54B parameters.
- ``glm5``: GLM-5.2 as published (examples/glm5_2/config.json) at full width (hidden 6144, 64 MLA heads, latent ranks,
  the DSA indexer with 32 heads and top-k 2048, vocabulary 154880), with 6 layers and 8 routed experts so that its
  training state fits one H200: layers 0-2 dense with a full DSA indexer, layers 3-5 sparse sharing layer 2's top-k
  (GLM-5.2's IndexShare rule, verl_npu/parity/models.py), about 4.6B parameters.

``--tiny`` shrinks both to what the CPU runs in seconds, keeping the structure (GQA with biases; MLA, DSA with a
shared layer, routed and shared experts). Tensor names and shapes are those of the published checkpoints (the
parity models' tables, verl_npu/parity/models.py::checkpoint_tensors).

Weights are uniform random, each tensor from its own seed (its name), in torch's generator: a few seconds for
billions of values, where the parity models' counter-based generator takes minutes. Written in bf16 (GLM-5's router
bias in fp32) or, with ``--fp8``, in the DeepSeek-V3 block format GLM-5's FP8 release uses: every projection weight
as float8 e4m3 codes with ``<name>_scale_inv`` (float32, one per 128x128 block), the config's
``quantization_config`` saying so; embeddings, the LM head, norms, the router and the indexer's head weights stay
bf16, as in that release. Files are shards of at most 4 GiB with ``model.safetensors.index.json``, as published
checkpoints are, plus a word-level tokenizer (verl's HFModelConfig loads one).

    python bench/rl_step_models.py --model dense [--fp8] [--tiny] --out DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from verl_npu.parity.models import ParityModel, checkpoint_tensors

MODELS = ("dense", "glm5")
SHARD_BYTES = 4 << 30  # the largest shard, as published checkpoints cut theirs
FP8_BLOCK = 128  # weight_block_size of DeepSeek-V3's and GLM-5's FP8 releases
FP8_MAX = 448.0  # the largest finite float8 e4m3fn value
INDEX_FILE = "model.safetensors.index.json"

_SIZES: dict[tuple[str, bool], dict[str, Any]] = {
    ("dense", False): dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
    ),
    ("dense", True): dict(
        vocab_size=512, hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    ),
    ("glm5", False): dict(num_hidden_layers=6, n_routed_experts=8, max_position_embeddings=32768),
    ("glm5", True): dict(
        num_hidden_layers=4, vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=64,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=4,
        index_head_dim=32, index_topk=8, max_position_embeddings=256,
    ),
}  # fmt: skip
# bf16 in GLM-5's FP8 release and in DeepSeek-V3's: besides embeddings, head, norms and biases (not 2-D projections)
_NOT_QUANTISED = ("lm_head.weight", "embed_tokens.weight", "mlp.gate.weight", "indexer.weights_proj.weight")


def parity_model(model: str, tiny: bool) -> ParityModel:
    """The model as a :class:`ParityModel` (its config builder and tensor table), sizes as this module says."""
    if model not in MODELS:
        raise ValueError(f"--model {model!r}: expected one of {', '.join(MODELS)}")
    family = "qwen2_5" if model == "dense" else "glm5_2"
    sizes = tuple(sorted(_SIZES[(model, tiny)].items()))
    return ParityModel(f"rl_step_{model}{'_tiny' if tiny else ''}", family, sizes, seq_len=0, batch=0, micro_batches=0)


def hf_config(model: str, tiny: bool, fp8: bool = False) -> dict[str, Any]:
    config = parity_model(model, tiny).config
    config.pop("quantization_config", None)
    config["torch_dtype"] = "bfloat16"
    if fp8:
        config["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }  # fmt: skip
    return config


def tensor_table(model: str, tiny: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, kind) of the checkpoint."""
    return checkpoint_tensors(parity_model(model, tiny))


def parameter_count(model: str, tiny: bool) -> int:
    return sum(math.prod(shape) for shape, _ in tensor_table(model, tiny).values())


def bf16_weight(name: str, shape: tuple[int, ...], kind: str) -> torch.Tensor:
    """The tensor's bf16 values (fp32 for GLM-5's router bias): uniform, scaled by its kind, seeded by its name."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & ((1 << 63) - 1)
    values = torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).mul_(2).sub_(1)
    if kind == "norm":
        values.mul_(0.25).add_(1.0)
    elif kind == "bias":
        values.mul_(0.1)
    else:  # the embedding too: tied to the LM head, it must give logits of unit variance, not log-probs of -50
        values.mul_(math.sqrt(3.0 / shape[-1]))  # unit output variance on unit inputs
    dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
    return values.to(dtype)


def quantised(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the FP8 checkpoint stores this tensor as e4m3 codes with block scales."""
    if len(shape) != 2 or name.endswith(_NOT_QUANTISED):
        return False
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight", "indexer.wq_b.weight", "indexer.wk.weight"))


def quantize_block_fp8(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, float32 scale per block): each 128x128 block scaled so that its largest magnitude is e4m3's
    largest value, the scale being what ``code * scale`` multiplies back (the format's ``weight_scale_inv``)."""
    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // block) * block, -(-cols // block) * block, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = amax / FP8_MAX
    codes = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).view_as(padded)[:rows, :cols]
    return codes.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def _stored(name: str, shape: tuple[int, ...], kind: str, fp8: bool) -> dict[str, torch.Tensor]:
    weight = bf16_weight(name, shape, kind)
    if not (fp8 and quantised(name, shape)):
        return {name: weight}
    codes, scale = quantize_block_fp8(weight)
    return {name: codes, name + "_scale_inv": scale}


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ``t0 .. t{vocab-1}`` (verl's model config loads the checkpoint's tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t1").save_pretrained(path)


def write(
    model: str, out: str | Path, *, tiny: bool = False, fp8: bool = False, shard_bytes: int = SHARD_BYTES
) -> Path:
    """The checkpoint in ``out``: config.json, shards of at most ``shard_bytes``, the index, the tokenizer."""
    from safetensors.torch import save_file

    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes={shard_bytes}: give a positive size in bytes (published checkpoints: 4 GiB)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")):
        raise FileExistsError(f"{out} already holds safetensors files: give an empty or new directory")
    # one shard's tensors at a time in host memory: a full shard is written (under a temporary name, as the final
    # name needs the shard count) before the next one is made
    shard_names: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = total = 0
    for name, (shape, kind) in tensor_table(model, tiny).items():
        for stored_name, tensor in _stored(name, shape, kind, fp8).items():
            if current and current_bytes + tensor.nbytes > shard_bytes:
                shard_names.append(_write_shard(out, current, len(shard_names) + 1, save_file))
                current, current_bytes = {}, 0
            current[stored_name] = tensor
            current_bytes += tensor.nbytes
            total += tensor.nbytes
    shard_names.append(_write_shard(out, current, len(shard_names) + 1, save_file))
    weight_map: dict[str, str] = {}
    for number, names in enumerate(shard_names, start=1):
        final = out / f"model-{number:05d}-of-{len(shard_names):05d}.safetensors"
        (out / f"model-{number:05d}.safetensors.partial").rename(final)
        weight_map |= dict.fromkeys(names, final.name)
    index_text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
    (out / INDEX_FILE).write_text(index_text + "\n")
    config = hf_config(model, tiny, fp8)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_tokenizer(out, config["vocab_size"])
    return out


def _write_shard(out: Path, tensors: dict[str, torch.Tensor], number: int, save_file: Any) -> list[str]:
    save_file(tensors, str(out / f"model-{number:05d}.safetensors.partial"), {"format": "pt"})
    return list(tensors)


def safetensors_files(path: str | Path) -> list[Path]:
    return sorted(Path(path).glob("*.safetensors"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--tiny", action="store_true", help="the CPU-sized variant")
    parser.add_argument("--fp8", action="store_true", help="FP8 block format (e4m3 codes + 128x128 block scales)")
    parser.add_argument("--shard-bytes", type=int, default=SHARD_BYTES)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    path = write(args.model, args.out, tiny=args.tiny, fp8=args.fp8, shard_bytes=args.shard_bytes)
    files = safetensors_files(path)
    size = sum(f.stat().st_size for f in files)
    print(f"{path}: {parameter_count(args.model, args.tiny):,} parameters, {len(files)} shards, {size / 1e9:.3f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
