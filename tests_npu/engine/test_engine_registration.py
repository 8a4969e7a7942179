"""The NPU engine registers with verl's EngineRegistry and is selected for (npu, huawei)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CODE = """
import json, os
import verl
from verl.workers.engine.base import EngineRegistry
picked = {}
for vendor in ("huawei", "other"):
    os.environ["VERL_ENGINE_DEVICE"], os.environ["VERL_ENGINE_VENDOR"] = "npu", vendor
    models = ("language_model", "value_model")
    picked[vendor] = {m: EngineRegistry.get_engine_cls(m, "megatron").__qualname__ for m in models}
print(json.dumps(picked))
"""


def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_NPU_", "VERL_USE_EXTERNAL", "VERL_ENGINE_"))}
    return subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, env={**base, **env}, timeout=600, check=False
    )


def test_npu_huawei_selects_our_engine_and_other_vendors_keep_verls():
    done = run({"VERL_USE_EXTERNAL_MODULES": "verl_npu.megatron_adaptor"})
    assert done.returncode == 0, done.stderr[-3000:]
    picked = json.loads(done.stdout.strip().splitlines()[-1])
    assert picked["huawei"] == {
        "language_model": "NPUMegatronEngineWithLMHead",
        "value_model": "NPUMegatronEngineWithValueHead",
    }
    assert picked["other"]["language_model"] == "MindspeedEngineWithLMHead"  # verl's own npu engine


def test_without_the_layer_verl_falls_back_to_its_mindspeed_engine():
    done = run({})
    assert done.returncode == 0, done.stderr[-3000:]
    picked = json.loads(done.stdout.strip().splitlines()[-1])
    assert picked["huawei"]["language_model"] == "MindspeedEngineWithLMHead"
