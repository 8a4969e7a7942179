"""The verl-facing NPU Megatron engine: thin subclasses of verl 0.9.1's Megatron engines.

Registered in verl's EngineRegistry as device ``npu``, vendor ``huawei`` for ``language_model`` and
``value_model``; verl looks up ``(device, vendor)`` before ``device``, so this engine takes
precedence over verl's own MindSpeed engine on Ascend (``VERL_ENGINE_DEVICE`` /
``VERL_ENGINE_VENDOR`` select it elsewhere, e.g. in tests). The work lives in platform-neutral
pieces: the build plan (verl_npu.engine.build_plan) and the offload manager (verl_npu.engine.offload).
"""

from __future__ import annotations

import logging

from verl.utils.device import get_device_name
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.megatron import MegatronEngineWithLMHead, MegatronEngineWithValueHead

from verl_npu import platform as _platform
from verl_npu.engine.build_plan import build_plan
from verl_npu.engine.offload import OffloadManager

logger = logging.getLogger(__name__)
DEVICE, VENDOR = "npu", "huawei"


class NPUMegatronEngineMixin:
    """Build plan before the model is built; the offload manager behind ``to()``."""

    _offload_manager: OffloadManager | None = None

    def _init_device_mesh(self):
        self.build_plan = build_plan(
            self.engine_config, self.optimizer_config, self.model_config.hf_config, _platform.detect()
        )
        # MindSpeed-only flags are not TransformerConfig fields: keep megatron's config clean.
        self.engine_config.override_transformer_config = dict(self.build_plan.transformer_overrides)
        self.engine_config.override_ddp_config = {
            **self.build_plan.ddp_overrides,
            **dict(self.engine_config.override_ddp_config or {}),
        }
        if self.build_plan.mindspeed_repatch is not None:
            from mindspeed.megatron_adaptor import repatch

            repatch(dict(self.build_plan.mindspeed_repatch))
        logger.info("verl-npu engine build plan: %s", self.build_plan)
        super()._init_device_mesh()

    def _offloader(self) -> OffloadManager:
        if self._offload_manager is None:
            self._offload_manager = OffloadManager(self.module, self.optimizer, device=get_device_name())
        return self._offload_manager

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        wanted = (("params", model), ("grads", grad and model), ("optimizer", optimizer and self.optimizer is not None))
        kinds = [kind for kind, on in wanted if on]
        manager = self._offloader()
        if device == "cpu":
            manager.offload(kinds)
        elif device == get_device_name():
            manager.onload(kinds)
        else:
            raise ValueError(f"verl-npu engine: cannot move state to {device!r}; use 'cpu' or {get_device_name()!r}")


@EngineRegistry.register(model_type="language_model", backend="megatron", device=DEVICE, vendor=VENDOR)
class NPUMegatronEngineWithLMHead(NPUMegatronEngineMixin, MegatronEngineWithLMHead):
    """verl's Megatron LM engine with the verl-npu build plan and offload manager."""


@EngineRegistry.register(model_type="value_model", backend="megatron", device=DEVICE, vendor=VENDOR)
class NPUMegatronEngineWithValueHead(NPUMegatronEngineMixin, MegatronEngineWithValueHead):
    """verl's Megatron value engine with the verl-npu build plan and offload manager."""
