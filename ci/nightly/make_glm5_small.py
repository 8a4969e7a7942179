"""Write a randomly initialised small GLM-5-shaped checkpoint (the nightly DSA job's model).

Usage: python make_glm5_small.py MODEL_DIR OUT_DIR. MODEL_DIR is ci/nightly/models/glm5_small: the
config (MLA + DSA + MoE) and the small tokenizer made by make_glm5_small_tokenizer.py, both versioned
there because the runners hold no GLM-5 checkpoint. Seeded, so every nightly trains the same model.
Skips the work when OUT_DIR already holds a checkpoint made from the same files.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
OPTIONAL_FILES = ("generation_config.json",)


def source_stamp(model_dir: Path) -> dict[str, str]:
    """sha256 of every file the checkpoint is made from: a changed config or tokenizer remakes it."""
    missing = [name for name in ("config.json", *TOKENIZER_FILES) if not (model_dir / name).is_file()]
    if missing:
        raise SystemExit(
            f"make_glm5_small.py: {model_dir} has no {', '.join(missing)}; pass ci/nightly/models/glm5_small "
            "(the tokenizer files are made by ci/nightly/make_glm5_small_tokenizer.py)"
        )
    names = ["config.json", *TOKENIZER_FILES, *(n for n in OPTIONAL_FILES if (model_dir / n).is_file())]
    return {name: hashlib.sha256((model_dir / name).read_bytes()).hexdigest() for name in names}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    model_dir, out = Path(argv[0]), Path(argv[1])
    wanted = source_stamp(model_dir)
    made = out / "config.json"
    if made.is_file() and json.loads(made.read_text()).get("_source") == wanted:
        print(f"{out}: already made from {model_dir}")
        return 0
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    config = GlmMoeDsaConfig.from_pretrained(model_dir)
    model = GlmMoeDsaForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    # after save_pretrained: the shipped generation config (GLM's stop tokens) replaces the one it derives
    for name in wanted:
        if name != "config.json":
            shutil.copy(model_dir / name, tmp / name)
    saved = json.loads((tmp / "config.json").read_text())
    saved["_source"] = wanted
    (tmp / "config.json").write_text(json.dumps(saved, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
