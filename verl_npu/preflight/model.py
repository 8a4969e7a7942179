"""Where preflight's model config comes from: the HF config as a dict, the "model" check, and its origin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl_npu.checks import FAIL, OK, WARN, Check
from verl_npu.errors import UserError
from verl_npu.models import family as model_family
from verl_npu.preflight.model_shape import load_config

# where the model config came from (PreflightReport.model_origin)
FROM_MODEL_CONFIG, FROM_MODEL_PATH, FROM_BESIDE_SCRIPT, FROM_NAME = (
    "model-config",
    "model-path",
    "beside-script",
    "name",
)
Resolved = tuple[dict[str, Any] | None, Check, str | None]  # (HF config dict, the "model" check, origin)


def resolve_model(model_path: str | None, model_config: str | None, beside_script: str | None = None) -> Resolved:
    """The HF config (as a dict), the check saying where it came from, and that origin.

    In order: --model-config; the launch's model path when it is on this machine; a ``config.json`` beside the
    launch script (``beside_script``: an example ships its model's published architecture there, e.g.
    examples/glm5_2/config.json); for a path a registered model family names (verl_npu.models; a GLM-5 / GLM-5.2
    path, the usual case on a laptop) that family's config of the variant named, with a warning. Any other missing
    model is an error.
    """

    def failed(message: str) -> Resolved:
        return None, Check("config.model", FAIL, message), None

    source = model_config or model_path
    if source is not None and not isinstance(source, str):
        return failed(f"actor_rollout_ref.model.path={source!r}: expected a path or a model id")
    if source is None:
        return failed("no model: set actor_rollout_ref.model.path or --model-config")
    try:
        origin = FROM_MODEL_CONFIG if model_config else FROM_MODEL_PATH
        return load_config(source), Check("config.model", OK, f"model config from {source}"), origin
    except UserError as exc:  # the config is there but unusable: no stand-in replaces it
        return failed(str(exc) if str(source) in str(exc) else f"{source}: {exc}")
    except (ValueError, OSError) as exc:
        missing = exc
    if model_config is None and beside_script is not None:
        try:
            hf = load_config(beside_script)
        except (ValueError, OSError) as exc:  # a UserError (values out of range) too
            return failed(f"{model_path}: {missing}; and {beside_script}: {exc}")
        message = (
            f"model config from {beside_script} (beside the launch script): {model_path} is not on this machine; "
            "pass --model-config PATH to check another config.json"
        )
        return hf, Check("config.model", OK, message), FROM_BESIDE_SCRIPT
    name = Path(model_path).name if model_path else ""
    named = model_family.named_in(name) if model_config is None else None
    if named is not None:
        family, variant = named
        message = f"{model_path} is not on this machine; using {family.describe(variant)} (pass --model-config PATH "
        message += "to check the real config.json)"
        return family.variant_config(variant), Check("config.model", WARN, message), FROM_NAME
    return failed(f"{missing}; pass --model-config with a config.json, a model directory, 'glm5' or 'glm5.2'")
