"""The torch-bound half of preflight, in a child process that starts first.

verl's validation and transformers' model configs both import torch, and verl also tensordict and
ray: seconds of imports. A child process (``python -m verl_npu.preflight.worker``) starts them at
once while the parent reads the launch and composes the config without torch; then it reads one
request on stdin (the composed config and where the model config is) and answers with the model
config and verl's checks as JSON.

Answers are cached by what they depend on (the request, the model config file's bytes, the
versions of verl, transformers, verl-npu and Python, and this package's source), so a re-check after an
edit skips torch entirely. ``VERL_NPU_CACHE_DIR`` (default ``~/.cache/verl-npu``) holds them;
``--no-cache`` bypasses it.

An entry is sealed (the sha256 of its canonical JSON) and records the key it answers and the versions
of verl-npu, verl and Python that wrote it. One that is damaged, edited, written for another key or by
other versions, or whose structure is not an answer's, is ignored with a warning naming the file, and
rewritten. A cache directory that cannot be written means no cache (a warning), never a failed check.
Entries are written whole (a temporary file of this process, then a rename). The child runs in a
process group of its own that a timeout or an interrupt ends (verl_npu.processes).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pickle
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_npu import atomic, processes
from verl_npu.bounded_read import MIB, NotReadable, expand_user, read_bytes, read_text
from verl_npu.checks import FAIL, STATUSES, Check

CACHE_FORMAT = 2  # what a cache entry holds (format 1: the answer and its sha256 only)
WORKER_COMMAND = (sys.executable, "-m", "verl_npu.preflight.worker")
WORKER_TIMEOUT_S = 300.0
MAX_MODEL_CONFIG_BYTES = 16 * MIB
MAX_ENTRY_BYTES = 64 * MIB  # one cache entry (the composed config and the model config)
MAX_CONFIG_FILES = 4096  # YAML files under the config directories a cache key hashes
MAX_CONFIG_BYTES = 64 * MIB


def cache_dir() -> Path:
    return Path(os.environ.get("VERL_NPU_CACHE_DIR") or Path.home() / ".cache" / "verl-npu") / "preflight"


def _warn(message: str) -> None:
    print(f"verl-npu preflight: warning: {message}", file=sys.stderr)


def _model_file_digest(source: str | None) -> str:
    if not source:
        return ""
    try:
        path = expand_user(source)
        path = path / "config.json" if path.is_dir() else path
        return hashlib.sha256(read_bytes(path, MAX_MODEL_CONFIG_BYTES)).hexdigest() if path.is_file() else "absent"
    except (OSError, ValueError):  # NotReadable; a path the OS cannot take
        return "unreadable"


def _config_dirs_digest(digest: Any, dirs: Sequence[Path]) -> bool:
    """Hash the YAML files the overrides compose from; False when there are more than a cache key can read."""
    files = total = 0
    for config_dir in dirs:
        for source in sorted(config_dir.rglob("*.yaml")):
            files += 1
            if files > MAX_CONFIG_FILES:
                return False
            try:
                data = read_bytes(source, MAX_CONFIG_BYTES)
            except NotReadable as exc:  # a FIFO or a directory named x.yaml, an unreadable file: its name only
                data = f"not read: {exc}".encode()
            total += len(data)
            if total > MAX_CONFIG_BYTES:
                return False
            digest.update(str(source.relative_to(config_dir)).encode() + data)
    return True


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def versions() -> dict[str, str]:
    """What wrote a cache entry: an entry from other versions answers for code that is not running."""
    return {"verl-npu": _version("verl-npu"), "verl": _version("verl"), "python": platform.python_version()}


def cache_key(
    config_name: str | None,
    overrides: list[str],
    model_config: str | None,
    beside_script: str | None = None,
    config_dirs: Sequence[Path] | None = None,
) -> str | None:
    """What the answer depends on, known before composition (so a hit neither composes nor starts the worker).

    ``config_dirs``: the directories the overrides compose from (None: verl's own), hashed with every YAML in them;
    None when they hold more than :data:`MAX_CONFIG_FILES` files or :data:`MAX_CONFIG_BYTES` (then no cache).
    """
    from verl_npu.preflight.compose import verl_config_dir

    dirs = list(config_dirs) if config_dirs is not None else [verl_config_dir()]
    request = [config_name, overrides, model_config, beside_script, [str(d) for d in dirs]]
    digest = hashlib.sha256(json.dumps(request).encode())
    for dist in ("verl", "transformers", "verl-npu"):
        digest.update(_version(dist).encode())
    digest.update(sys.version.encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):  # the checks themselves
        digest.update(source.read_bytes())
    if not _config_dirs_digest(digest, dirs):  # what the overrides compose with
        return None
    return digest.hexdigest()


def _seal(answer: dict[str, Any], key: str = "") -> str:
    """The cache file's text: the entry (format, the key it answers, the versions that wrote it, the answer) and
    the sha256 of its canonical JSON, so a damaged file is never trusted."""
    entry = {"format": CACHE_FORMAT, "key": key, "versions": versions(), "answer": answer}
    body = json.dumps(entry, sort_keys=True, allow_nan=False)
    return json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), **entry}, sort_keys=True, allow_nan=False)


def _read_entry(text: str, key: str | None = None) -> tuple[dict[str, Any] | None, str]:
    """(the answer, '') from a cache file's text, or (None, why it is not one for ``key`` and these versions)."""
    try:
        sealed = json.loads(text)
    except (ValueError, RecursionError):
        return None, "not JSON (truncated or damaged)"
    if not isinstance(sealed, dict) or not isinstance(sealed.get("sha256"), str):
        return None, "not a sealed cache entry (no sha256)"
    entry = {k: v for k, v in sealed.items() if k != "sha256"}
    try:
        body = json.dumps(entry, sort_keys=True, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return None, "not a sealed cache entry"
    if hashlib.sha256(body.encode()).hexdigest() != sealed["sha256"]:
        return None, "its sha256 does not match its content (damaged or edited)"
    if entry.get("format") != CACHE_FORMAT:
        return None, f"written in cache format {_short(entry.get('format'))}, this verl-npu writes {CACHE_FORMAT}"
    if key is not None and entry.get("key") != key:
        return None, f"it answers another launch (key {_short(entry.get('key'))}), not {key[:16]}..."
    if entry.get("versions") != versions():
        return None, f"written by {_short(entry.get('versions'))}, this is {versions()}"
    why = answer_problem(entry.get("answer"))
    if why:
        return None, f"its answer is malformed ({why})"
    return entry["answer"], ""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _unseal(text: str, key: str | None = None) -> dict[str, Any] | None:
    """The answer of a cache file, or None when it is not one ``_seal`` wrote for ``key`` with these versions."""
    return _read_entry(text, key)[0]


def _check_problem(where: str, value: Any) -> str:
    if not isinstance(value, Mapping):
        return f"{where} is not a check"
    keys = set(value)
    if not {"check", "status", "detail"} <= keys <= {"check", "status", "detail", "fix"}:
        return f"{where} has keys {sorted(map(str, keys))[:6]}"
    if not all(isinstance(v, str) for v in value.values()) or value["status"] not in STATUSES:
        return f"{where} has a value that is not a string or an unknown status"
    return ""


def answer_problem(answer: Any) -> str:
    """'' when ``answer`` has the structure the worker writes (checks, model config, origin, files); else what not."""
    if not isinstance(answer, Mapping):
        return "not a mapping"
    missing = {"hf", "model_check", "checks"} - set(answer)
    if missing:
        return f"missing {sorted(missing)}"
    if answer["hf"] is not None and not isinstance(answer["hf"], Mapping):
        return "hf is neither null nor a mapping"
    if not isinstance(answer.get("model_origin"), str | None):
        return "model_origin is neither null nor a string"
    problem = _check_problem("model_check", answer["model_check"])
    if problem:
        return problem
    if not isinstance(answer["checks"], list):
        return "checks is not a list"
    for i, check in enumerate(answer["checks"]):
        problem = _check_problem(f"checks[{i}]", check)
        if problem:
            return problem
    files = answer.get("model_files", {})
    if not isinstance(files, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        return "model_files is not a mapping of path -> digest"
    if "composed" in answer:
        composed = answer["composed"]
        if not isinstance(composed, Mapping) or not isinstance(composed.get("config"), str):
            return "composed has no config text"
        if not isinstance(composed.get("checks"), list):
            return "composed.checks is not a list"
        for i, check in enumerate(composed["checks"]):
            problem = _check_problem(f"composed.checks[{i}]", check)
            if problem:
                return problem
    return ""


def start_child() -> subprocess.Popen[bytes]:
    """A worker process, importing verl at once. Preflight starts it before it reads the launch: the child's imports
    are a cold check's critical path, and the launch must be read before the cache can say it is not needed."""
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "", "VERL_USE_EXTERNAL_PLUGINS": "none"}
    # its own process group: a timeout or an interrupt ends it and whatever it started (processes.end_group)
    return processes.start(WORKER_COMMAND, stdin=True, env=env)


class PreflightWorker:
    """Answers from the cache, or from a child process started at construction."""

    def __init__(
        self,
        config_name: str | None,
        overrides: list[str],
        model_config: str | None,
        use_cache: bool,
        beside_script: str | None = None,
        config_dirs: Sequence[Path] | None = None,
        child: subprocess.Popen[bytes] | None = None,
    ):
        """``beside_script``: a config.json next to the launch script, the model config when the model is not here;
        ``config_dirs``: the directories the overrides compose from (None: verl's own); ``child``: a worker process
        from :func:`start_child`, used when the answer is not cached and ended when it is."""
        self._beside = beside_script
        self._key = cache_key(config_name, overrides, model_config, beside_script, config_dirs) if use_cache else None
        if use_cache and self._key is None:
            where = ", ".join(map(str, config_dirs or ()))
            _warn(f"the config directories {where} hold more than {MAX_CONFIG_FILES} YAML files or "
                  f"{MAX_CONFIG_BYTES >> 20} MiB: checking without a cache")  # fmt: skip
        self._cache = self._usable_cache(cache_dir() / f"{self._key}.json") if self._key is not None else None
        self._composed: Any = None
        self._hit = self._cached_answer()
        self._child = None
        if self._hit is None:
            self._child = child or start_child()
        elif child is not None:  # started before the launch was read, in case the answer was not cached
            processes.end_group(child, grace=0.5)

    @staticmethod
    def _usable_cache(path: Path) -> Path | None:
        """``path`` when its directory exists or can be made and is writable; else None with a warning (no cache)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            _warn(f"cannot create the cache directory {path.parent} ({exc.strerror or exc}); checking without a "
                  "cache (set VERL_NPU_CACHE_DIR to a writable directory, or pass --no-cache)")  # fmt: skip
            return None
        why = atomic.output_problem(path)  # a directory or FIFO named like the entry is left alone, never read
        if why is not None:
            _warn(f"the preflight cache is unusable: {path}: {why}; checking without a cache (set "
                  "VERL_NPU_CACHE_DIR to a writable directory, or pass --no-cache)")  # fmt: skip
            return None
        return path

    @property
    def running(self) -> bool:
        """A child process is working on the answer (no cached one)."""
        return self._child is not None and self._child.poll() is None

    def _cached_answer(self) -> dict[str, Any] | None:
        if self._cache is None:
            return None
        if not self._cache.exists():
            return None
        try:
            text = read_text(self._cache, MAX_ENTRY_BYTES)
        except NotReadable as exc:
            self._ignored(f"unreadable ({exc})")
            return None
        answer, why = _read_entry(text, self._key)
        if answer is None:  # damaged or foreign: the worker recomputes it and the file is rewritten whole
            self._ignored(why)
            return None
        if "composed" in answer:
            from omegaconf import DictConfig, OmegaConf

            try:
                composed = OmegaConf.create(answer["composed"]["config"])
            except Exception as exc:  # omegaconf and yaml raise their own types for text that is not a config
                self._ignored(f"its composed config does not parse ({type(exc).__name__})")
                return None
            if not isinstance(composed, DictConfig):
                self._ignored("its composed config is not a mapping")
                return None
            self._composed = composed
        # the model config file may have changed since (same path, new bytes)
        if any(_model_file_digest(src) != digest for src, digest in answer.get("model_files", {}).items()):
            return None
        return answer

    def _ignored(self, why: str) -> None:
        _warn(f"ignoring the cache entry {self._cache}: {why}; recomputing it and writing it again "
              "(--no-cache skips the cache)")  # fmt: skip

    def cached_composition(self) -> tuple[Any, list[Check]] | None:
        """verl's composed config and the composition's checks as a cached answer recorded them (None: compose)."""
        if self._hit is None or self._composed is None:
            return None
        return self._composed, [Check(**c) for c in self._hit["composed"]["checks"]]

    def ask(
        self,
        config: Any,
        model_path: str | None,
        model_config: str | None,
        compose_checks: Sequence[Check] = (),
        timeout: float = WORKER_TIMEOUT_S,
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
            if self._child is None:  # no cached answer means a child (the constructor starts one)
                return self._failed("it was never started")
            done = processes.communicate(self._child, pickle.dumps(request), timeout=timeout, text=False)
            err = processes.decode(done.stderr)
            if done.timed_out:
                why = f"did not answer within {timeout:g} s (its process group was ended)"
                return self._failed(why)
            if done.returncode != 0:
                return self._failed(err.strip().splitlines()[-1] if err.strip() else f"exit {done.returncode}")
            lines = processes.decode(done.stdout).strip().splitlines()
            try:
                answer = json.loads(lines[-1])
            except (IndexError, ValueError, RecursionError):
                return self._failed("it printed no JSON answer")
            why = answer_problem(answer)
            if why:
                return self._failed(f"its answer is malformed ({why})")
            sources = (model_path, model_config, self._beside)
            answer["model_files"] = {src: _model_file_digest(src) for src in sources if src}
            answer["composed"] = {"config": composed, "checks": [c.to_dict() for c in compose_checks]}
            if self._cache is not None:
                self._store(answer)
        checks = [Check(**c) for c in answer["checks"]]
        return answer["hf"], Check(**answer["model_check"]), checks, answer.get("model_origin")

    @staticmethod
    def _failed(why: str) -> tuple[None, Check, list[Check], None]:
        failed = Check("config.verl-validation", FAIL, f"the preflight worker failed: {why}")
        model = Check("config.model", FAIL, "not resolved (the preflight worker failed)")
        return None, model, [failed], None

    def _store(self, answer: dict[str, Any]) -> None:
        """Write the cache file whole or not at all; a cache that cannot be written costs speed, never the check."""
        if self._cache is None or self._key is None:
            return
        try:
            text = _seal(answer, self._key)
        except (ValueError, TypeError) as exc:  # a value JSON cannot hold (NaN in a model config): not cached
            _warn(f"not caching this answer: {exc}")
            return
        try:
            atomic.write_text(self._cache, text)  # a temporary file of this process, then a rename
        except (OSError, atomic.OutputPathError) as exc:  # the entry's path became a directory or FIFO meanwhile
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            _warn(f"cannot write the cache entry {self._cache} ({why}); the check is complete, "
                  "the next one recomputes it (--no-cache skips the cache)")  # fmt: skip

    def cancel(self) -> None:
        """End the child and its process group if it is still working (an error or an interrupt in the parent)."""
        if self._child is not None and self._child.poll() is None:
            processes.end_group(self._child, grace=0.5)


def _serve() -> None:
    from verl_npu.preflight import verl_validation
    from verl_npu.preflight.model import resolve_model

    verl_validation.import_verl_quietly()  # the slow part, before the request arrives
    request = pickle.loads(sys.stdin.buffer.read())  # only ever our parent's pipe, never a file
    checks = verl_validation.validate_with_verl(request["config"])
    hf, model_check, origin = resolve_model(request["model_path"], request["model_config"], request["beside_script"])
    answer = {
        "hf": hf,
        "model_check": model_check.to_dict(),
        "checks": [c.to_dict() for c in checks],
        "model_origin": origin,
    }
    print(json.dumps(answer, default=str), flush=True)


def _answer_and_leave() -> None:
    """Serve one request, then leave without the interpreter's teardown.

    The parent reads the answer at end-of-file, i.e. when this process has exited, and the teardown of what verl
    imports (torch, transformers, ray) took 1.1 s, more than half of what a cold check added to ``import verl``
    (docs/preflight.md). Nothing here needs it: the answer is flushed, no file is open for writing, nothing
    registered an exit handler that matters. An error still exits normally, with its traceback on stderr.
    """
    _serve()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _answer_and_leave()
