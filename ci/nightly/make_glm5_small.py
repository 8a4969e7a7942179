"""Write a randomly initialised small GLM-5-shaped checkpoint (the nightly DSA job's model).

Usage: python make_glm5_small.py CONFIG_DIR OUT_DIR [TOKENIZER_DIR]. The config (MLA + DSA + MoE,
GLM-5's vocabulary) is versioned in ci/nightly/models/glm5_small; the tokenizer files are copied
from TOKENIZER_DIR (default: $MODEL_ROOT/GLM-5.2). Seeded, so every nightly trains the same model.
Skips the work when OUT_DIR already holds a checkpoint of the same config.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    config_dir, out = Path(argv[0]), Path(argv[1])
    tokenizer_dir = Path(argv[2]) if len(argv) == 3 else Path(os.environ.get("MODEL_ROOT", "/models")) / "GLM-5.2"
    wanted = json.loads((config_dir / "config.json").read_text())
    if (out / "config.json").is_file() and json.loads((out / "config.json").read_text()).get("_source") == wanted:
        print(f"{out}: already made from {config_dir}")
        return 0
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    config = GlmMoeDsaConfig.from_pretrained(config_dir)
    model = GlmMoeDsaForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, tmp / name)
    if not (tmp / "tokenizer.json").is_file() and not (tmp / "tokenizer_config.json").is_file():
        raise SystemExit(f"no tokenizer files in {tokenizer_dir}: pass the GLM-5 tokenizer directory")
    saved = json.loads((tmp / "config.json").read_text())
    saved["_source"] = wanted
    (tmp / "config.json").write_text(json.dumps(saved, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
