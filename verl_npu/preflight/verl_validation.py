"""verl's own validation of a composed launch config: preflight's child process (verl_npu.preflight.worker).

verl's ``validate_config`` and its config dataclasses' ``__post_init__`` checks import torch, tensordict and ray
(seconds), so they run in the child while the parent composes (verl_npu.preflight.compose) and checks the engine
(verl_npu.preflight.engine_checks); the parent imports nothing from here.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from verl_npu.checks import FAIL, OK, WARN, Check


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
