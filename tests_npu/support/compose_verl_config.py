"""Stands in for `python` in a launch script: composes verl's Hydra config instead of training.

Invoked as `compose_verl_config.py -m verl.trainer.main_ppo --config-name=NAME OVERRIDES...`; it
composes verl 0.9.1's own config with the overrides (Hydra's compose API, struct mode, so an unknown
key fails) and prints the resolved config as JSON. Exit status 2 names the offending override.
"""

import json
import sys
from pathlib import Path

import verl.trainer.config
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


def main(argv: list[str]) -> int:
    if argv[:2] != ["-m", "verl.trainer.main_ppo"]:
        print(f"expected '-m verl.trainer.main_ppo', got {argv[:2]}", file=sys.stderr)
        return 2
    config_name = "ppo_trainer"
    overrides = []
    for arg in argv[2:]:
        if arg.startswith("--config-name="):
            config_name = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    config_dir = str(Path(verl.trainer.config.__file__).parent)
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose(config_name=config_name, overrides=overrides)
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException) as exc:
        print(f"verl config rejected the overrides: {exc}", file=sys.stderr)
        return 2
    json.dump({"config_name": config_name, "overrides": overrides, "config": resolved}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
