"""Check a launch's overrides against verl 0.9.1's own config: Hydra composition, then verl's validation.

No copy of verl's schema lives here. The overrides are composed with Hydra's compose API on the
config directory of the installed verl (struct mode: an unknown key fails), then verl's
``validate_config`` and config dataclasses run their own checks, and the engine's build plan
(``verl_npu.engine.build_plan``, the code the engine itself runs) judges the verl-npu features.
What this module adds is the diagnosis: the nearest valid key for a misspelling, a migration note
for keys verl removed, and every bad override reported at once instead of the first.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from verl_npu.bounded_read import NotReadable, expand_user
from verl_npu.checks import FAIL, OK, WARN, Check, failed
from verl_npu.errors import UserError
from verl_npu.preflight.values import MEGATRON, ROLE_SECTIONS, LaunchValues

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
                path = f"{prefix}.{key}" if prefix else str(key)
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
    checks: list[Check] = []
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


def import_verl_quietly():
    """Import verl for its validators without loading plugins or external modules into preflight."""
    saved = {k: os.environ.get(k) for k in ("VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")}
    os.environ["VERL_USE_EXTERNAL_MODULES"] = ""
    os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    try:
        import verl  # noqa: F401
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def needs_reference_policy(config: Any) -> bool:
    """verl.trainer.ppo.utils.need_reference_policy, without importing that module (1.5 s of imports)."""
    return bool(config.algorithm.get("use_kl_in_reward", False) or config.actor_rollout_ref.actor.use_kl_loss)


def needs_critic(config: Any) -> bool:
    """verl.trainer.ppo.utils.need_critic (a critic only for GAE unless critic.enable says otherwise)."""
    if config.critic.get("enable") is not None:
        return bool(config.critic.enable)
    return config.algorithm.adv_estimator == "gae"


# the values verl's validate_config multiplies and divides before it checks them (verl/utils/config.py)
_VALIDATE_CONFIG_OPERANDS = (
    "trainer.n_gpus_per_node",
    "trainer.nnodes",
    "data.train_batch_size",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size",
    "actor_rollout_ref.actor.megatron.context_parallel_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
)


def _null_operands(config) -> list[str]:
    from omegaconf import OmegaConf

    return [key for key in _VALIDATE_CONFIG_OPERANDS if OmegaConf.select(config, key, default=0) is None]


def validate_with_verl(config: Any) -> list[Check]:
    """verl's own validation: ``validate_config`` plus the role dataclasses' ``__post_init__`` checks."""
    import contextlib
    import io

    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    import_verl_quietly()
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    checks = []
    try:
        OmegaConf.to_container(config, resolve=True)
    except OmegaConfBaseException as exc:
        return [Check("config.interpolation", FAIL, f"a value does not resolve: {exc}")]
    try:
        use_ref, use_critic = needs_reference_policy(config), needs_critic(config)
    except OmegaConfBaseException as exc:  # a section the roles depend on was deleted (~key)
        text = " ".join(str(exc).split())
        return [Check("config.verl-validation", FAIL, f"verl's roles (reference policy, critic): {text}")]
    steps: list[tuple[str, Any]] = [
        ("verl validate_config", lambda: validate_config(config, use_reference_policy=use_ref, use_critic=use_critic)),
        ("actor_rollout_ref.rollout", lambda: omega_conf_to_dataclass(config.actor_rollout_ref.rollout)),
    ]
    if use_ref:
        steps.append(("actor_rollout_ref.ref", lambda: omega_conf_to_dataclass(config.actor_rollout_ref.ref)))
    if use_critic:
        steps.append(("critic", lambda: omega_conf_to_dataclass(config.critic)))
    for name, run in steps:
        try:
            # validate_config prints a banner and verl warns about defaults; the report says what matters
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run()
        except (AssertionError, ValueError, TypeError, KeyError, HydraException, OmegaConfBaseException) as exc:
            unset = _null_operands(config) if isinstance(exc, TypeError) and "NoneType" in str(exc) else []
            for key in unset:  # the key, not Python's "unsupported operand type(s) ... 'NoneType'"
                msg = f"{key} is not set (null), and {name} computes with it: set {key}=N in the launch"
                checks.append(Check("config.value", FAIL, msg))
            if not unset:
                text = str(exc).strip() or type(exc).__name__
                checks.append(Check("config.verl-validation", FAIL, f"{name}: {text}"))
        except OSError as exc:  # e.g. the model path is not on this machine
            checks.append(Check("config.verl-validation", WARN, f"{name}: not checked here ({exc})"))
        except Exception as exc:
            text = f"{type(exc).__name__}: {str(exc).strip()}".rstrip(": ")
            checks.append(
                Check("config.verl-validation", FAIL, f"{name}: verl's validation broke on this config ({text})")
            )
    if not checks:
        checks.append(Check("config.verl-validation", OK, "verl's validate_config and config dataclasses accept it"))
    return checks


def _megatron_roles(config: Mapping[str, Any], values: LaunchValues) -> dict[str, tuple[Mapping[str, Any], Any]]:
    """Each Megatron role's (engine config, optimizer config): the actor, the reference model, an enabled critic.

    Which roles are Megatron engines is the typed view's answer (an FSDP actor has none); their sections are there
    and are mappings (the view checked).
    """
    roles = {}
    for role in values.megatron_roles:
        section = config
        for key in ROLE_SECTIONS[role].split("."):
            section = section[key]
        optim = {} if role == "ref" else section.get("optim") or {}  # the reference model has no optimizer
        roles[role] = (section[MEGATRON], optim)
    return roles


def engine_plans(
    config: Mapping[str, Any], values: LaunchValues, hf_config: Any, platform: str
) -> tuple[dict[str, Any], list[Check]]:
    """The engine's build plan for each Megatron role (resolved config), the call the engine makes at build time.

    ``values``: the config's typed view; every value the plans compute with is in range. Returns the roles'
    BuildPlans (those that build) and the checks: every violated rule of every role at once.
    """
    from verl_npu.engine.build_plan import BuildPlanError, build_plan

    roles = _megatron_roles(config, values)
    plans, checks = {}, []
    for role, (engine, optim) in roles.items():
        try:
            plan = plans[role] = build_plan(engine, optim, hf_config, platform)
        except BuildPlanError as exc:
            checks += [Check(f"engine.{role}-build-plan", FAIL, f"{role}: {problem}") for problem in exc.problems]
            continue
        features = ", ".join(plan.features) or "no verl-npu features"
        checks.append(Check(f"engine.{role}-build-plan", OK, f"{role} on {platform}: {features}"))
        checks += [Check(f"engine.{role}-build-plan", OK, f"{role}: {note}") for note in plan.notes]
        checks += [Check(f"engine.{role}-build-plan", WARN, f"{role}: {note}") for note in plan.warnings]
    layouts: dict[str, Any] = {}  # each distinct pipeline layout once (the ref usually mirrors the actor)
    for role, (engine, _) in roles.items():
        key = _layout_key(engine)
        if all(_layout_key(other) != key for other in layouts.values()):
            layouts[role] = engine
    checks += model_bridge_checks(hf_config, layouts)
    return plans, checks


def _layout_key(engine: Mapping[str, Any]) -> tuple:
    from verl_npu.engine.build_plan import pipeline_layout

    otc = engine.get("override_transformer_config") or {}
    return pipeline_layout(engine), otc.get("num_layers_per_virtual_pipeline_stage")


def model_bridge_checks(hf_config: Mapping[str, Any], layouts: Mapping[str, Any] | None = None) -> list[Check]:
    """Whether the engine's mbridge bridge can build this model (GLM-5's mapping; others: mbridge's own), and for
    GLM-5.2's IndexShare layers which layers of each pipeline stage (of each role's layout) are full and shared."""
    import types

    from verl_npu.models.glm5.config import MODEL_TYPE, SHARED, glm5_config_fields, indexer_types

    if hf_config.get("model_type") != MODEL_TYPE:
        return []
    try:
        glm5_config_fields(types.SimpleNamespace(**hf_config))
    except (NotImplementedError, ValueError) as exc:
        return [Check("engine.model-bridge", FAIL, f"the model cannot be built: {exc}")]
    kinds = indexer_types(types.SimpleNamespace(**hf_config))
    message = f"{MODEL_TYPE}: verl-npu's GLM-5 bridge maps this config"
    if SHARED not in kinds:
        return [Check("engine.model-bridge", OK, f"{message}; every layer's DSA indexer is full")]
    full = [i for i, kind in enumerate(kinds) if kind != SHARED]
    message += (
        f"; IndexShare: {len(full)} full / {len(kinds) - len(full)} shared DSA layers (a shared layer reuses the most "
        f"recent full layer's top-k and has no indexer), full {_numbers(full)}"
    )
    checks = [Check("engine.model-bridge", OK, message)]
    for role, engine in (layouts or {}).items():
        prefix = f"{role} " if len(layouts) > 1 else ""
        checks += [Check("engine.model-bridge", OK, prefix + line) for line in stage_layout_lines(kinds, engine)]
    return checks


def _numbers(layers: Sequence[int]) -> str:
    return ", ".join(map(str, layers)) if layers else "none"


def stage_layout_lines(kinds: Sequence[str], engine: Mapping[str, Any]) -> list[str]:
    """Per pipeline stage (model chunk): its layers, which are full, and whether it starts on a carried top-k.

    E.g. "stage 1: layers 9-18, full 10, 14, 18; starts shared (carry from stage 0)". Empty when the layers do not
    split over the layout (the mesh check says why).
    """
    from verl_npu.engine.build_plan import model_chunks, pipeline_layout
    from verl_npu.engine.index_share import stage_plans

    try:
        chunks = model_chunks(len(kinds), pipeline_layout(engine, len(kinds)))
    except ValueError:
        return []
    plans = stage_plans(kinds, [c.num_layers for c in chunks])
    lines = []
    for i, (chunk, plan) in enumerate(zip(chunks, plans, strict=True)):
        layers = range(chunk.first_layer, chunk.first_layer + chunk.num_layers)
        full = [n for n in layers if kinds[n] != "shared"]
        line = f"{chunk.name}: {chunk.layers}, " + (
            "all full" if len(full) == len(layers) else f"full {_numbers(full)}"
        )
        if plan.receives:
            line += f"; starts shared (carry from {chunks[i - 1].name})"
        lines.append(line)
    return lines


def rollout_environment_checks(config: Mapping[str, Any], env: Mapping[str, str]) -> list[Check]:
    """Environment the rollout cannot start with: expandable segments under vLLM's sleep mode."""
    from verl_npu.contracts.vllm_ascend import ALLOC_CONF_VARIABLE, EXPANDABLE_SEGMENTS

    rollout = _section(config, "actor_rollout_ref", "rollout")
    value = env.get(ALLOC_CONF_VARIABLE)
    if rollout.get("name") != "vllm" or value is None or EXPANDABLE_SEGMENTS not in value:
        return []
    if not rollout.get("enable_sleep_mode", True):
        return [
            Check(
                "launch.npu-alloc-conf",
                OK,
                f"{ALLOC_CONF_VARIABLE}={value} with vLLM sleep mode off (rollout.enable_sleep_mode=False)",
            )
        ]
    return [
        Check(
            "launch.npu-alloc-conf",
            FAIL,
            f"{ALLOC_CONF_VARIABLE}={value} with vLLM sleep mode (actor_rollout_ref.rollout.enable_sleep_mode=True, "
            f"verl's default): vllm-ascend's CaMemAllocator asserts that it does not contain {EXPANDABLE_SEGMENTS}, "
            f"so the rollout cannot start. Instead: leave {ALLOC_CONF_VARIABLE} unset (the verl-npu images do not "
            "set it), or add +actor_rollout_ref.rollout.enable_sleep_mode=False (a RolloutConfig field verl's "
            "YAML does not list)",
        )
    ]


# a model directory named for its FP8 release (GLM-5.2-FP8, DeepSeek-V3-fp8, ...)
_FP8_NAME = re.compile(r"(?:^|[-_.])fp8(?:$|[-_.])", re.IGNORECASE)


def rollout_model_checks(
    config: Mapping[str, Any],
    hf_config: Mapping[str, Any],
    env: Mapping[str, str],
    platform: str = "ascend",
    model_path: str | None = None,
    model_config_is_stand_in: bool = False,
) -> list[Check]:
    """What the rollout cannot serve for this model: GLM-5 / GLM-5.2 (glm_moe_dsa) with vLLM on Ascend without
    verl's GLM-5.2 patch, an FP8 checkpoint with vLLM on Ascend, and MTP speculative decoding on a glm_moe_dsa model.

    ``env`` is the trainer's environment (the launch's exports and --env); ``model_config_is_stand_in``: the config
    came from somewhere else than the model path (beside the script, or a name fallback), so the path's name is
    evidence too.
    """
    from verl_npu.contracts.vllm_ascend import GLM52_PATCH_ON_VALUES, GLM52_PATCH_VARIABLE
    from verl_npu.models.glm5.config import MODEL_TYPE

    rollout = _section(config, "actor_rollout_ref", "rollout")
    name = rollout.get("name")
    vllm_on_ascend = name == "vllm" and platform == "ascend"
    glm = hf_config.get("model_type") == MODEL_TYPE
    checks = []
    if glm and vllm_on_ascend:
        value = env.get(GLM52_PATCH_VARIABLE)
        shown = " is not set" if value is None else f"={value!r}"
        if value is not None and value.strip().lower() in GLM52_PATCH_ON_VALUES:  # verl's own test of the value
            checks.append(
                Check(
                    "launch.glm52-patch",
                    OK,
                    f"{GLM52_PATCH_VARIABLE}={value}: verl's vllm-ascend 0.23 GLM-5.2 fixes are on",
                )
            )
        else:
            checks.append(
                Check(
                    "launch.glm52-patch",
                    FAIL,
                    f"{GLM52_PATCH_VARIABLE}{shown} in the launch's environment: verl 0.9.1 ships vllm-ascend 0.23's "
                    "fixes for GLM-5.2 RL weight updates (SFA keeps kv_b_proj for later weight syncs instead of "
                    "disposing it, the SFA indexer weight scale, the explicit residual add before RMSNorm, an NPU "
                    "synchronize before sleep, wake-up and dummy-batch fixes) only behind it: without them SFA "
                    "disposes kv_b_proj after the first load, so later weight syncs cannot rebuild its absorbed "
                    "weights and the rollout no longer samples from the policy. Instead: set "
                    f"{GLM52_PATCH_VARIABLE}=1 in the launch's env file (verl-npu forwards the variables named there "
                    f"to the Ray workers; verl accepts {'/'.join(GLM52_PATCH_ON_VALUES)})",
                )
            )
    quant = hf_config.get("quantization_config") or {}
    method = str(quant.get("quant_method") or "").lower() if isinstance(quant, Mapping) else ""
    named_fp8 = model_config_is_stand_in and bool(model_path) and bool(_FP8_NAME.search(Path(model_path).name))
    if vllm_on_ascend and (method == "fp8" or named_fp8):
        why = (
            "its config.json has quantization_config.quant_method=fp8"
            if method == "fp8"
            else f"its name says FP8 (the config preflight used is a stand-in: {model_path} is not on this machine)"
        )
        checks.append(
            Check(
                "config.rollout-fp8",
                FAIL,
                f"actor_rollout_ref.model.path={model_path} is an FP8 checkpoint: {why}. The rollout is vLLM on "
                "Ascend, and vllm-ascend 0.23's fp8 path is MXFP8 for the Ascend 950 only while its SFA attention "
                "asserts an unquantised kv_b_proj, so the rollout cannot load it on A2/A3. Instead: point "
                "actor_rollout_ref.model.path at the BF16 checkpoint (the actor trains in BF16 either way)",
            )
        )
    mtp = _section(rollout, "mtp")  # what verl's rollout reads (by default an interpolation of model.mtp)
    speculative = _section(rollout, "engine_kwargs", "vllm").get("speculative_config")
    if not (isinstance(speculative, Mapping) and "mtp" in str(speculative.get("method") or "")):
        speculative = None  # a separate draft model or n-gram drafting needs no weights from the actor
    mtp_on = bool(mtp.get("enable") and mtp.get("enable_rollout"))
    if glm and (mtp_on or speculative):
        what = (
            "actor_rollout_ref.model.mtp.enable=True with enable_rollout=True (verl's MtpConfig: the rollout "
            f"drafts with the model's MTP layer, method {mtp.get('method')!r})"
            if mtp_on
            else f"actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config={speculative!r}"
        )
        load_format = str(rollout.get("load_format") or "dummy")
        dummy = load_format.startswith("dummy")
        checks.append(
            Check(
                "config.rollout-mtp",
                FAIL if dummy else WARN,
                f"{what}: speculative decoding on {MODEL_TYPE}, but verl-npu's GLM-5 bridge builds no MTP layers, so "
                "verl's weight sync sends none"
                + (
                    f" and under load_format={load_format!r} (verl's default) the draft head stays random: every "
                    "draft is rejected"
                    if dummy
                    else f"; under load_format={load_format!r} the draft head is the checkpoint's and never follows "
                    "the policy, so acceptance falls as training moves"
                )
                + ". Instead: turn rollout MTP off (actor_rollout_ref.model.mtp.enable_rollout=False and no "
                "speculative_config)",
            )
        )
    return checks


def _section(config: Any, *keys: str) -> Mapping[str, Any]:
    """The mapping at ``keys`` ({} where a section is absent, e.g. deleted with ``~``, or not a mapping)."""
    for key in keys:
        config = config.get(key) if isinstance(config, Mapping) else None
    return config if isinstance(config, Mapping) else {}


def as_mapping(config: Any) -> Mapping[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(config, resolve=True)
