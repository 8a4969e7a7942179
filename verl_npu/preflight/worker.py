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
import pickle
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verl_npu.checks import FAIL, Check


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
    """What the answer depends on, known before composition (so a hit neither composes nor starts the worker)."""
    from verl_npu.preflight.config_check import verl_config_dir

    digest = hashlib.sha256(json.dumps([config_name, overrides, model_config, beside_script]).encode())
    for dist in ("verl", "transformers", "verl-npu"):
        digest.update(importlib.metadata.version(dist).encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):  # the checks themselves
        digest.update(source.read_bytes())
    config_dir = verl_config_dir()
    for source in sorted(config_dir.rglob("*.yaml")):  # what the overrides compose with
        digest.update(str(source.relative_to(config_dir)).encode() + source.read_bytes())
    return digest.hexdigest()


def _seal(answer: dict[str, Any]) -> str:
    """The cache file's text: the answer and the sha256 of its canonical JSON, so a damaged file is never trusted."""
    body = json.dumps(answer, sort_keys=True)
    return json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "answer": answer}, sort_keys=True)


def _unseal(text: str) -> dict[str, Any] | None:
    """The answer of a cache file, or None when it is not one ``_seal`` wrote (truncated, edited, older format)."""
    try:
        sealed = json.loads(text)
        answer = sealed["answer"]
        body = json.dumps(answer, sort_keys=True)
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(answer, dict) or hashlib.sha256(body.encode()).hexdigest() != sealed.get("sha256"):
        return None
    return answer


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
                env=env,
            )

    @property
    def running(self) -> bool:
        """A child process is working on the answer (no cached one)."""
        return self._child is not None and self._child.poll() is None

    def _cached_answer(self) -> dict[str, Any] | None:
        if self._cache is None:
            return None
        try:
            answer = _unseal(self._cache.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            return None
        if answer is None:  # damaged: the worker recomputes it and the file is rewritten whole
            return None
        # the model config file may have changed since (same path, new bytes)
        if any(_model_file_digest(src) != digest for src, digest in answer.get("model_files", {}).items()):
            return None
        return answer

    def cached_composition(self) -> tuple[Any, list[Check]] | None:
        """verl's composed config and the composition's checks as a cached answer recorded them (None: compose)."""
        if self._hit is None or "composed" not in self._hit:
            return None
        from omegaconf import OmegaConf

        composed = self._hit["composed"]
        return OmegaConf.create(composed["config"]), [Check(**c) for c in composed["checks"]]

    def ask(
        self,
        config: Any,
        model_path: str | None,
        model_config: str | None,
        compose_checks: Sequence[Check] = (),
        timeout: float = 300.0,
    ) -> tuple[dict[str, Any] | None, Check, list[Check], str | None]:
        """(HF config dict or None, the model check, verl's validation checks, where the model config came from).

        ``compose_checks`` are what composing ``config`` reported; a cached answer keeps both, so a re-check of the
        same launch does not compose again.
        """
        from omegaconf import OmegaConf

        answer = self._hit
        if answer is None:
            composed = OmegaConf.to_yaml(config)
            request = {
                "config": config,  # pickled: the child rebuilds it in milliseconds, from YAML it takes 0.2 s
                "model_path": model_path,
                "model_config": model_config,
                "beside_script": self._beside,
            }
            out, err = self._child.communicate(pickle.dumps(request), timeout=timeout)
            err = err.decode(errors="replace")
            if self._child.returncode != 0:
                tail = err.strip().splitlines()[-1] if err.strip() else f"exit {self._child.returncode}"
                failed = Check("config.verl-validation", FAIL, f"the preflight worker failed: {tail}")
                model = Check("config.model", FAIL, "not resolved (the preflight worker failed)")
                return None, model, [failed], None
            answer = json.loads(out)
            sources = (model_path, model_config, self._beside)
            answer["model_files"] = {src: _model_file_digest(src) for src in sources if src}
            answer["composed"] = {"config": composed, "checks": [c.to_dict() for c in compose_checks]}
            if self._cache is not None:
                self._store(answer)
        checks = [Check(**c) for c in answer["checks"]]
        return answer["hf"], Check(**answer["model_check"]), checks, answer.get("model_origin")

    def _store(self, answer: dict[str, Any]) -> None:
        """Write the cache file whole or not at all; a cache that cannot be written costs speed, never the check."""
        partial = self._cache.with_name(f".{self._cache.name}.{os.getpid()}")
        try:
            self._cache.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(_seal(answer), encoding="utf-8")
            partial.replace(self._cache)  # atomic: concurrent preflights never read half a file
        except OSError:
            partial.unlink(missing_ok=True)

    def cancel(self) -> None:
        if self._child is not None and self._child.poll() is None:
            self._child.kill()
            self._child.communicate()


def _serve() -> None:
    from verl_npu.preflight import config_check
    from verl_npu.preflight.model import resolve_model

    config_check.import_verl_quietly()  # the slow part, before the request arrives
    request = pickle.loads(sys.stdin.buffer.read())  # only ever our parent's pipe, never a file
    checks = config_check.validate_with_verl(request["config"])
    hf, model_check, origin = resolve_model(request["model_path"], request["model_config"], request["beside_script"])
    answer = {"hf": hf, "model_check": model_check.to_dict(), "checks": [c.to_dict() for c in checks]}
    answer["model_origin"] = origin
    print(json.dumps(answer, default=str))


if __name__ == "__main__":
    _serve()
