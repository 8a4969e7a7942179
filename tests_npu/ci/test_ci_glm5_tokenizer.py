"""The small GLM-5 nightly model ships its own tokenizer: it loads, round-trips, templates verl's prompts,
fits the config's vocabulary, is reproducible from its generator, and make_glm5_small.py builds on it."""

from __future__ import annotations

import hashlib
import json
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

MODEL = REPO / "ci/nightly/models/glm5_small"
GENERATOR = REPO / "ci/nightly/make_glm5_small_tokenizer.py"
MAKE_MODEL = REPO / "ci/nightly/make_glm5_small.py"
SHIPPED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
TEXT = (
    "Priya buys 14 notebooks at $2.50 each and pays with a $50 bill. How much change does she get?\n"
    "14 * 2.50 = <<14*2.50=35>>35 dollars; 50 - 35 = <<50-35=15>>15.\n#### 15\n"
    "Unicode survives too: 3\u00d74 \u2014 \u201cquoted\u201d \u20ac12, na\u00efve caf\u00e9."
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


def test_the_tokenizer_loads_through_verl_and_round_trips_text_exactly(tokenizer):
    from verl.utils.tokenizer import hf_tokenizer

    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.unk_token_id is None  # byte-level: nothing is ever unknown
    # the problems' everyday words are learned whole; digits stay single, as in GLM's tokenizer
    words = tokenizer.convert_ids_to_tokens(
        tokenizer.encode(" how much change does she get?", add_special_tokens=False)
    )
    assert words == ["\u0120how", "\u0120much", "\u0120change", "\u0120does", "\u0120she", "\u0120get", "?"]
    digits = tokenizer.convert_ids_to_tokens(tokenizer.encode("2026", add_special_tokens=False))
    assert digits == ["2", "0", "2", "6"]
    through_verl = hf_tokenizer(str(MODEL))
    assert through_verl.encode(TEXT, add_special_tokens=False) == ids
    assert through_verl.pad_token_id == tokenizer.pad_token_id == tokenizer.eos_token_id


def test_the_chat_template_renders_glm_turns_and_refuses_an_unknown_role(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 * 7?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "[gMASK]<sop><|system|>\nBe brief.<|user|>\nWhat is 6 * 7?<|assistant|>\n"
    # verl's length filter tokenizes the rendered prompt; every special token must stay one id
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens[:3] == ["[gMASK]", "<sop>", "<|system|>"] and tokens[-2:] == ["<|assistant|>", "Ċ"]
    with pytest.raises(Exception, match="chat role tool is not one of"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_every_id_the_model_can_sample_decodes_and_the_stop_tokens_match_the_configs(tokenizer):
    config = json.loads((MODEL / "config.json").read_text())
    generation = json.loads((MODEL / "generation_config.json").read_text())
    # a random-weight model samples its whole vocabulary; vLLM detokenizes each sampled id
    assert len(tokenizer) == config["vocab_size"]
    assert all(tokenizer.convert_ids_to_tokens(i) is not None for i in range(config["vocab_size"]))
    assert config["eos_token_id"] == generation["eos_token_id"]
    assert tokenizer.convert_ids_to_tokens(config["eos_token_id"]) == ["<|endoftext|>", "<|user|>", "<|observation|>"]
    assert config["pad_token_id"] == generation["pad_token_id"] == tokenizer.pad_token_id
    assert sum((MODEL / name).stat().st_size for name in SHIPPED) < 1 << 20


def test_the_shipped_files_are_exactly_what_the_generator_writes(tmp_path):
    done = subprocess.run([sys.executable, str(GENERATOR), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for name in SHIPPED:
        assert (tmp_path / name).read_bytes() == (MODEL / name).read_bytes(), (
            f"{name} differs from the generator's output: rerun python {GENERATOR.relative_to(REPO)}"
        )


def test_verls_dataset_keeps_every_prepared_gsm8k_prompt(tokenizer, tmp_path):
    import pandas as pd
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from verl_npu.ci.gsm8k import prepare

    raw = tmp_path / "gsm8k"
    (raw / "main").mkdir(parents=True)
    questions = ["Sam has 4 bags of 6 apples. How many apples?", "A bus seats 40. How many seats in 3 buses?"]
    answers = ["4 * 6 = <<4*6=24>>24\n#### 24", "40 * 3 = <<40*3=120>>120\n#### 120"]
    for split in ("train", "test"):
        frame = pd.DataFrame({"question": questions, "answer": answers})
        frame.to_parquet(raw / "main" / f"{split}-00000-of-00001.parquet")
    outputs, _ = prepare(raw, tmp_path / "out")
    config = OmegaConf.create({"max_prompt_length": 1024, "cache_dir": str(tmp_path / "cache")})
    dataset = RLHFDataset(str(outputs["train"]), tokenizer, config)
    # verl silently drops a prompt its chat template cannot render: all of them must survive
    assert len(dataset) == len(questions)
    rendered = tokenizer.apply_chat_template(dataset[0]["raw_prompt"], add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("[gMASK]<sop><|user|>\n" + questions[0])


def shrunk_model_dir(tmp_path: Path) -> Path:
    """The shipped model directory with the architecture cut down to seconds of CPU work (same vocabulary)."""
    small = tmp_path / "glm5_small"
    shutil.copytree(MODEL, small)
    config = json.loads((small / "config.json").read_text())
    config |= {
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "qk_head_dim": 32,
        "v_head_dim": 16, "index_n_heads": 2, "index_head_dim": 32, "index_topk": 8,
        "indexer_types": ["full", "full"], "mlp_layer_types": ["dense", "sparse"],
    }  # fmt: skip
    (small / "config.json").write_text(json.dumps(config))
    return small


def make_model(model_dir: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(MAKE_MODEL), str(model_dir), str(out)], capture_output=True, text=True, cwd=REPO
    )


def test_make_glm5_small_builds_a_checkpoint_with_the_shipped_tokenizer_and_remakes_it_on_change(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    model_dir, out = shrunk_model_dir(tmp_path), tmp_path / "model"
    done = make_model(model_dir, out)
    assert done.returncode == 0, done.stderr
    for name in SHIPPED:
        assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name
    config = AutoConfig.from_pretrained(out)
    assert config.vocab_size == len(AutoTokenizer.from_pretrained(out)) == 4096
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as weights:
        assert weights.get_slice("model.embed_tokens.weight").get_shape() == [4096, 64]
    done = make_model(model_dir, out)
    assert done.returncode == 0 and "already made" in done.stdout
    # a new tokenizer (or config) makes a new checkpoint instead of reusing the old one
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"model_max_length": 4096}))
    done = make_model(model_dir, out)
    assert done.returncode == 0 and "parameters" in done.stdout, done.stdout
    stamp = json.loads((out / "config.json").read_text())["_source"]
    expected = hashlib.sha256((model_dir / "tokenizer_config.json").read_bytes()).hexdigest()
    assert stamp["tokenizer_config.json"] == expected


def test_make_glm5_small_names_missing_tokenizer_files(tmp_path):
    model_dir = tmp_path / "bare"
    model_dir.mkdir()
    shutil.copy(MODEL / "config.json", model_dir)
    with pytest.raises(SystemExit, match=r"has no tokenizer\.json, tokenizer_config\.json.*make_glm5_small_tokenizer"):
        runpy.run_path(str(MAKE_MODEL), run_name="make_glm5_small").get("main")([str(model_dir), str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
