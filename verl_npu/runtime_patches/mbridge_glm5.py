"""Register verl-npu's GLM-5 bridge (HF model type ``glm_moe_dsa``) with mbridge.

Changes: adds ``mbridge.models.GLM5Bridge`` (verl_npu.engine.bridges.glm5.GLM5Bridge) and registers it
in mbridge's model registry for ``glm_moe_dsa``, as mbridge's own model modules register theirs. Skipped,
with one log line, when mbridge already registers a bridge for ``glm_moe_dsa``.
Why: verl 0.9.1 builds Megatron models through ``mbridge.AutoBridge`` when
``megatron.vanilla_mbridge=True`` (the verl-npu stack's only path); mbridge 0.15.1 has no bridge for
GLM-5, so ``AutoBridge.from_config`` fails with "Unregistered model type: glm_moe_dsa".
Upstream: mbridge 0.15.1 mbridge/models/__init__.py (the model modules that register bridges through
mbridge/core/bridge.py::register_model).
Remove when: mbridge ships a glm_moe_dsa bridge with DSA for megatron-core 0.18 (then this patch skips).
"""

from __future__ import annotations

from verl_npu.patching import Patch
from verl_npu.runtime_patches._targets import EVERY_PLATFORM, MEGATRON_CORE

MODEL_TYPE = "glm_moe_dsa"


def _build(_original):
    from verl_npu.engine.bridges.glm5 import GLM5Bridge, register

    register()
    return GLM5Bridge


def _registered_upstream() -> str | None:
    from mbridge.core.bridge import _MODEL_REGISTRY

    from verl_npu.engine.bridges import glm5

    existing = _MODEL_REGISTRY.get(MODEL_TYPE)
    if existing is None or existing is glm5.GLM5Bridge:
        return None
    glm5.register()  # logs, once, that mbridge's own bridge is kept
    return f"mbridge registers {existing.__module__}.{existing.__qualname__} for {MODEL_TYPE}; kept"


PATCH = Patch(
    id="mbridge-glm5-bridge",
    target="mbridge.models:GLM5Bridge",
    kind="add",
    platforms=EVERY_PLATFORM,
    requires={"mbridge": "==0.15.1", **MEGATRON_CORE},
    source_sha256="edc6247c53a6714865ddc86dc750ecaca023ba6059c733eb9ecb61c35e286bbc",
    reason="mbridge has no glm_moe_dsa bridge, so verl's vanilla-mbridge path cannot build GLM-5 (MLA + MoE + DSA)",
    upstream="mbridge 0.15.1 mbridge/models/__init__.py (bridges registered with core/bridge.py::register_model)",
    remove_when="mbridge registers a glm_moe_dsa bridge with DSA for megatron-core 0.18",
    build=_build,
    condition=_registered_upstream,
)
PATCHES = (PATCH,)
