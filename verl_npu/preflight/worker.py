"""The torch-bound half of preflight, in a child process that starts first.

verl's validation and transformers' model configs both import torch, and verl also tensordict and
ray: seconds of imports. A child process (``python -m verl_npu.preflight.worker``) starts them at
once while the parent reads the launch and composes the config without torch; then it reads one
request on stdin (the composed config and where the model config is) and answers with the model
config and verl's checks as JSON.

Answers are cached by what they depend on (the request, the model config file's bytes, the
versions of verl, transformers and verl-npu, and this package's source), so a re-check after an
edit skips torch entirely. ``VERL_NPU_CACHE_DIR`` (default ``~/.cache/verl-npu``) holds them;
``--no-cache`` bypasses it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from verl_npu.preflight.checks import FAIL, Check


def cache_dir() -> Path:
    return Path(os.environ.get("VERL_NPU_CACHE_DIR") or Path.home() / ".cache" / "verl-npu") / "preflight"


def _model_file_digest(source: str | None) -> str:
    if not source:
        return ""
    path = Path(source).expanduser()
    path = path / "config.json" if path.is_dir() else path
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "absent"


def cache_key(
    config_name: str | None, overrides: list[str], model_config: str | None, beside_script: str | None = None
) -> str:
    """What the answer depends on, known before composition (so a hit never starts the worker)."""
    digest = hashlib.sha256(json.dumps([config_name, overrides, model_config, beside_script]).encode())
    for dist in ("verl", "transformers", "verl-npu"):
        digest.update(importlib.metadata.version(dist).encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):  # the checks themselves
        digest.update(source.read_bytes())
    return digest.hexdigest()


class PreflightWorker:
    """Answers from the cache, or from a child process started at construction."""

    def __init__(
        self,
        config_name: str | None,
        overrides: list[str],
        model_config: str | None,
        use_cache: bool,
        beside_script: str | None = None,
    ):
        """``beside_script``: a config.json next to the launch script, the model config when the model is not here."""
        self._beside = beside_script
        key = cache_key(config_name, overrides, model_config, beside_script)
        self._cache = cache_dir() / f"{key}.json" if use_cache else None
        self._hit = self._cached_answer()
        self._child = None
        if self._hit is None:
            env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "", "VERL_USE_EXTERNAL_PLUGINS": "none"}
            self._child = subprocess.Popen(
                [sys.executable, "-m", "verl_npu.preflight.worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )

    @property
    def running(self) -> bool:
        """A child process is working on the answer (no cached one)."""
        return self._child is not None and self._child.poll() is None

    def _cached_answer(self) -> dict[str, Any] | None:
        if self._cache is None or not self._cache.is_file():
            return None
        answer = json.loads(self._cache.read_text())
        # the model config file may have changed since (same path, new bytes)
        if any(_model_file_digest(src) != digest for src, digest in answer.get("model_files", {}).items()):
            return None
        return answer

    def ask(
        self, config: Any, model_path: str | None, model_config: str | None, timeout: float = 300.0
    ) -> tuple[dict[str, Any] | None, Check, list[Check], str | None]:
        """(HF config dict or None, the model check, verl's validation checks, where the model config came from)."""
        from omegaconf import OmegaConf

        answer = self._hit
        if answer is None:
            request = {
                "config": OmegaConf.to_yaml(config),
                "model_path": model_path,
                "model_config": model_config,
                "beside_script": self._beside,
            }
            out, err = self._child.communicate(json.dumps(request), timeout=timeout)
            if self._child.returncode != 0:
                tail = err.strip().splitlines()[-1] if err.strip() else f"exit {self._child.returncode}"
                failed = Check("config", "verl-validation", FAIL, f"the preflight worker failed: {tail}")
                model = Check("config", "model", FAIL, "not resolved (the preflight worker failed)")
                return None, model, [failed], None
            answer = json.loads(out)
            sources = (model_path, model_config, self._beside)
            answer["model_files"] = {src: _model_file_digest(src) for src in sources if src}
            if self._cache is not None:
                self._cache.parent.mkdir(parents=True, exist_ok=True)
                partial = self._cache.with_name(f".{self._cache.name}.{os.getpid()}")
                partial.write_text(json.dumps(answer))
                partial.replace(self._cache)  # atomic: concurrent preflights never read half a file
        checks = [Check(**c) for c in answer["checks"]]
        return answer["hf"], Check(**answer["model_check"]), checks, answer.get("model_origin")

    def cancel(self) -> None:
        if self._child is not None and self._child.poll() is None:
            self._child.kill()
            self._child.communicate()


def _serve() -> None:
    from verl_npu.preflight import config_check
    from verl_npu.preflight.model import resolve_model

    config_check.import_verl_quietly()  # the slow part, before the request arrives
    from omegaconf import OmegaConf

    request = json.loads(sys.stdin.read())
    checks = config_check.validate_with_verl(OmegaConf.create(request["config"]))
    hf, model_check, origin = resolve_model(request["model_path"], request["model_config"], request["beside_script"])
    answer = {"hf": hf, "model_check": model_check.to_dict(), "checks": [c.to_dict() for c in checks]}
    answer["model_origin"] = origin
    print(json.dumps(answer, default=str))


if __name__ == "__main__":
    _serve()
