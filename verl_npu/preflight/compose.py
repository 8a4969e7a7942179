"""Compose a launch's overrides with verl 0.9.1's own Hydra config, in preflight's parent process (no torch).

No copy of verl's schema lives here. The overrides are composed with Hydra's compose API on the config directory of
the installed verl (struct mode: an unknown key fails). What this module adds is the diagnosis: the nearest valid key
for a misspelling, a migration note for keys verl removed, and every bad override reported at once instead of the
first. verl's own validation of the composed config runs in the child process (verl_npu.preflight.verl_validation);
the engine's checks of it in the parent (verl_npu.preflight.engine_checks).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import re
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from verl_npu.bounded_read import NotReadable, expand_user
from verl_npu.checks import FAIL, OK, Check, failed
from verl_npu.errors import UserError

DEFAULT_CONFIG_NAME = "ppo_trainer"  # what verl.trainer.main_ppo composes without --config-name
OTC_SUFFIX = ".override_transformer_config."
DDP_SUFFIX = ".override_ddp_config."


# Keys verl removed, by their last path segment: why, and what to do instead.
REMOVED_KEYS = {
    "grad_offload": (
        "verl removed megatron.grad_offload (2026-08): param_offload=True now also releases the gradient "
        "buffers while the model is inactive. Delete the key (and set megatron.param_offload=True if you "
        "meant to offload)"
    ),
}


_KEY_IN_MESSAGE = (
    re.compile(r"Could not override '([^']+)'"),
    re.compile(r"An item is already at '([^']+)'"),
    re.compile(r"Could not delete from config\. '([^']+)'"),
    re.compile(r"Error parsing override '([^']+)'"),
    re.compile(r"Could not append to config\. An item is already at '([^']+)'"),
)
_INPUT_LINE = re.compile(r"input_line='((?:[^'\\]|\\.)*)'")  # the override, as Hydra's own ValueErrors quote it


def verl_config_dir() -> Path:
    """verl's Hydra config directory, found without importing verl (its import takes seconds)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("verl is not installed in this environment: run `bash install.sh --dev`")
    return Path(next(iter(spec.submodule_search_locations))) / "trainer" / "config"


def override_key(override: str) -> str:
    """The dotted key of a Hydra override (without +, ++ or ~ and without the value)."""
    return override.lstrip("+~").split("=", 1)[0].strip()


class ConfigSearchError(UserError):
    """--config-path or --config-dir names no directory preflight can compose from."""


@dataclasses.dataclass(frozen=True)
class ConfigSearch:
    """Where Hydra finds the launch's configs: the primary directory (verl's own unless ``--config-path``) and the
    ``--config-dir`` added to the search path."""

    primary: Path
    extra: Path | None = None

    @property
    def directories(self) -> tuple[Path, ...]:
        return (self.primary,) if self.extra is None else (self.primary, self.extra)

    def describe(self, config_name: str) -> str:
        if self.primary == verl_config_dir() and self.extra is None:
            return f"verl's {config_name}.yaml"
        return f"{config_name}.yaml from {', '.join(map(str, self.directories))}"


def config_search(
    config_path: str | None = None, config_dir: str | None = None, unknown: Sequence[str] = ()
) -> ConfigSearch:
    """The directories as ``python -m verl.trainer.main_ppo`` gives them to Hydra (hydra/_internal/utils.py).

    ``--config-path``: absolute, or relative to the directory of verl's ``main_ppo.py`` (the file declaring
    ``@hydra.main``), not to the working directory; ``--config-dir``: absolute, or relative to the working
    directory (preflight's, since the trainer's is only known when it runs). Raises ConfigSearchError naming the
    option for a placeholder (``unknown``: the launch's), a ``pkg://`` path or a directory that does not exist.
    """
    base = verl_config_dir()
    found: list[Path | None] = []
    for option, value, relative_to in (("--config-path", config_path, base.parent), ("--config-dir", config_dir, None)):
        if value is None:
            found.append(None)
            continue
        if any(placeholder in value for placeholder in unknown):
            raise ConfigSearchError(f"{option}={value}: only known when the launch runs, so preflight cannot compose "
                                    "the config; give the directory literally")  # fmt: skip
        if value.startswith("pkg://"):
            raise ConfigSearchError(f"{option}={value}: preflight composes from a directory; give the package's "
                                    "config directory as a path")  # fmt: skip
        try:
            path = expand_user(value.removeprefix("file://"))
        except NotReadable as exc:
            raise ConfigSearchError(f"{option}={value}: {exc}") from None
        relative = not path.is_absolute()
        if relative:
            path = (relative_to / path) if relative_to is not None else Path.cwd() / path
        path = Path(os.path.normpath(path))
        if not path.is_dir():
            anchor = f" (relative paths start at {relative_to})" if relative and relative_to is not None else ""
            raise ConfigSearchError(f"{option}={value}: {path} is not a directory{anchor}")
        found.append(path)
    return ConfigSearch(found[0] or base, found[1])


def _searchpath(search: ConfigSearch | None, overrides: Sequence[str]) -> list[str]:
    """The overrides, with ``--config-dir`` on Hydra's search path (merged into a ``hydra.searchpath`` override)."""
    if search is None or search.extra is None:
        return list(overrides)
    # quoted, so that a directory named with Hydra's list syntax (, ] ') stays one element
    extra = "'file://" + str(search.extra).replace("\\", "\\\\").replace("'", "\\'") + "'"
    out, merged = [], False
    for override in overrides:
        key, eq, value = override.partition("=")
        if key.lstrip("+") == "hydra.searchpath" and eq and value.strip().startswith("["):
            inner = value.strip()[1:-1].strip()
            override, merged = f"{key}=[{inner + ',' if inner else ''}{extra}]", True
        out.append(override)
    return out if merged else [*out, f"hydra.searchpath=[{extra}]"]


def _compose(config_name: str, overrides: Sequence[str], search: ConfigSearch | None = None):
    from hydra import compose, initialize_config_dir

    primary = search.primary if search is not None else verl_config_dir()
    with initialize_config_dir(config_dir=str(primary), version_base=None):
        return compose(config_name=config_name, overrides=_searchpath(search, overrides))


@cache
def _base_keys(config_name: str, search: ConfigSearch | None = None) -> tuple[frozenset[str], frozenset[str]]:
    """(every key path, every path holding a mapping) of verl's config without overrides."""
    from omegaconf import DictConfig, ListConfig

    leaves: set[str] = set()
    nodes: set[str] = {""}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, DictConfig):
            nodes.add(prefix)
            for key in node:
                name = str(key)
                path = f"{prefix}.{name}" if prefix else name
                leaves.add(path)
                walk(node._get_node(key), path)
        elif isinstance(node, ListConfig):
            leaves.add(prefix)

    walk(_compose(config_name, [], search), "")
    return frozenset(leaves), frozenset(nodes)


def nearest_key(key: str, known: frozenset[str], mappings: frozenset[str]) -> str | None:
    """The closest valid key: fix the first segment below the deepest existing parent, else whole-path match."""
    parts = key.split(".")
    depth = max(d for d in range(len(parts)) if ".".join(parts[:d]) in mappings)
    parent = ".".join(parts[:depth])
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
    match = difflib.get_close_matches(parts[depth], list(siblings), n=1, cutoff=0.6)
    if match:
        candidate = ".".join([siblings[match[0]], *parts[depth + 1 :]])
        if candidate in known:
            return candidate
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return match[0] if match else None


def _unknown_key_check(override: str, key: str, known: frozenset[str], mappings: frozenset[str]) -> Check:
    leaf = key.rsplit(".", 1)[-1]
    if leaf in REMOVED_KEYS:
        return Check("config.removed-key", FAIL, f"{override!r}: {REMOVED_KEYS[leaf]}")
    guess = nearest_key(key, known, mappings)
    hint = f"did you mean {guess!r}?" if guess else "no similar key exists in verl's config"
    return Check(
        "config.unknown-key",
        FAIL,
        f"{override!r}: verl 0.9.1's config has no key {key!r}; {hint} "
        f"(to add a key verl does not define, prefix it with '+')",
    )


def _dataclass_fields(relative_path: str, classes: Sequence[str]) -> frozenset[str]:
    """Field names of megatron-core dataclasses, read from their source file with ``ast``.

    Importing megatron.core costs seconds; preflight has a 5-second budget and runs on laptops.
    ``find_spec("megatron.core")`` imports only the (empty) ``megatron`` namespace package.
    """
    import ast

    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("megatron-core is not installed: run `bash install.sh --dev`")
    source = Path(next(iter(spec.submodule_search_locations))) / relative_path
    tree = ast.parse(source.read_text())
    fields = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            fields |= {
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            }
    if not fields:
        raise RuntimeError(f"{source}: none of {', '.join(classes)} found; megatron-core's layout changed")
    return frozenset(fields)


@cache
def _transformer_config_fields() -> frozenset[str]:
    return _dataclass_fields("model_parallel_config.py", ["ModelParallelConfig"]) | _dataclass_fields(
        "transformer/transformer_config.py", ["TransformerConfig", "MLATransformerConfig"]
    )


@cache
def _ddp_config_fields() -> frozenset[str]:
    return _dataclass_fields("distributed/distributed_data_parallel_config.py", ["DistributedDataParallelConfig"])


def _check_added_keys(overrides: Sequence[str]) -> list[Check]:
    """``+...override_transformer_config.X``: X must be a megatron or MindSpeed/verl-npu field."""
    from verl_npu.engine.build_plan import MINDSPEED_ONLY_KEYS

    checks = []
    for override in overrides:
        key = override_key(override)
        for suffix, fields, what in (
            (OTC_SUFFIX, lambda: _transformer_config_fields() | set(MINDSPEED_ONLY_KEYS), "TransformerConfig"),
            (DDP_SUFFIX, _ddp_config_fields, "DistributedDataParallelConfig"),
        ):
            if suffix not in key:
                continue
            field = key.split(suffix, 1)[1].split(".", 1)[0]
            valid = fields()
            if field not in valid:
                guess = difflib.get_close_matches(field, sorted(valid), n=1, cutoff=0.6)
                hint = f"did you mean {guess[0]!r}?" if guess else "see megatron-core 0.18's " + what
                checks.append(
                    Check(
                        "config.unknown-key",
                        FAIL,
                        f"{override!r}: {field!r} is neither a megatron-core {what} field nor a MindSpeed/verl-npu "
                        f"flag; {hint}",
                    )
                )
    return checks


def compose_config(
    config_name: str | None, overrides: Sequence[str], search: ConfigSearch | None = None
) -> tuple[Any, list[Check]]:
    """verl's composed DictConfig (None when it cannot be composed) and the checks that ran.

    ``search``: where the configs are (:func:`config_search`; None: verl's own config directory).
    """
    name = config_name or DEFAULT_CONFIG_NAME
    where = (search or ConfigSearch(verl_config_dir())).describe(name)
    try:  # the usual case, valid overrides: one composition, no diagnosis needed
        config = _compose(name, overrides, search)
    except Exception:  # Hydra rejects overrides with its own errors and with ValueError/TypeError/KeyError
        config = None
    if config is not None:
        checks = _check_added_keys(overrides)
        if not checks:
            checks.append(Check("config.compose", OK, f"{len(overrides)} overrides compose with {where}"))
        return config, checks
    try:
        known, mappings = _base_keys(name, search)
    except Exception as exc:  # a config that does not compose even without overrides
        text = " ".join(str(exc).split())
        return None, [Check("config.config-name", FAIL, f"--config-name={name}: cannot compose {where} ({text})")]
    checks = []
    kept: list[str] = []
    # Every bad key at once: Hydra would stop at the first.
    for override in overrides:
        key = override_key(override)
        if "=" not in override and not override.startswith("~"):
            checks.append(Check("config.bad-override", FAIL, f"{override!r}: an override needs KEY=VALUE"))
        elif override.startswith("+") and not override.startswith("++") and key in known:
            checks.append(
                Check("config.bad-override", FAIL, f"{override!r}: {key!r} exists in verl's config; drop the '+'")
            )
        elif not override.startswith("+") and "/" not in key and key not in known:
            checks.append(_unknown_key_check(override, key, known, mappings))
        else:
            kept.append(override)
    checks += _check_added_keys(kept)
    for _ in range(len(kept) + 1):
        try:
            config = _compose(name, kept, search)
            break
        except Exception as exc:
            message = " ".join(str(exc).split()) or type(exc).__name__
            offending = next((m.group(1) for p in _KEY_IN_MESSAGE if (m := p.search(message))), None)
            line = m.group(1) if (m := _INPUT_LINE.search(message)) else None
            index = next(
                (i for i, o in enumerate(kept) if o == line or (offending and override_key(o) == offending)), None
            )
            if index is None:
                checks.append(Check("config.compose", FAIL, f"verl's config rejected the overrides: {message}"))
                return None, checks
            checks.append(Check("config.bad-override", FAIL, f"{kept.pop(index)!r}: {message}"))
    else:  # pragma: no cover - the loop drops one override per failure, so it always ends
        return None, checks
    if not failed(checks):
        checks.append(Check("config.compose", OK, f"{len(overrides)} overrides compose with {where}"))
    return config, checks


def as_mapping(config: Any) -> Mapping[Any, Any]:
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(config, resolve=True)
    if not isinstance(container, dict):  # verl's configs compose to mappings; a list would be Hydra misused
        raise TypeError(f"verl's composed config is a {type(container).__name__}, not a mapping")
    return container
