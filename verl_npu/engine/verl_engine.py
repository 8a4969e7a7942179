"""The verl-facing NPU Megatron engine: thin subclasses of verl 0.9.1's Megatron engines.

Registered in verl's EngineRegistry as device ``npu``, vendor ``huawei`` for ``language_model`` and
``value_model``; verl looks up ``(device, vendor)`` before ``device``, so this engine takes
precedence over verl's own MindSpeed engine on Ascend (``VERL_ENGINE_DEVICE`` /
``VERL_ENGINE_VENDOR`` select it elsewhere, e.g. in tests). The work lives in platform-neutral
pieces: the build plan (verl_npu.engine.build_plan), the offload manager (verl_npu.engine.offload)
and, off Ascend, the local-spec layers and mbridge adapter (layer_spec, mbridge_local).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
from verl.utils.device import get_device_name
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.megatron import MegatronEngineWithLMHead, MegatronEngineWithValueHead

from verl_npu import platform as _platform
from verl_npu.engine import build, router_replay, save_staging
from verl_npu.engine.bridges import fast_export, fast_load, fast_read
from verl_npu.engine.build_plan import build_plan
from verl_npu.engine.offload import OffloadManager
from verl_npu.engine.optimizer_state import ensure_torch_adam_state, resync_torch_adam_steps

logger = logging.getLogger(__name__)
DEVICE, VENDOR = "npu", "huawei"


def loads_whole_checkpoint() -> bool:
    """Whether this process reads every tensor of the HF checkpoint itself: one pipeline stage, no expert
    parallelism, and rank 0 of its tensor and expert-tensor groups (fast_load's rule of who reads what)."""
    from megatron.core import parallel_state as mpu

    return (
        mpu.get_pipeline_model_parallel_world_size() == 1
        and mpu.get_expert_model_parallel_world_size() == 1
        and mpu.get_tensor_model_parallel_rank() == 0
        and mpu.get_expert_tensor_parallel_rank() == 0
    )


class NPUMegatronEngineMixin:
    """Build plan before the model is built; the offload manager behind ``to()`` and checkpoints.

    verl's own checkpoint and weight-export paths reload offloaded state with its helpers, which
    read host copies (``cpu_data``) that only its own offload creates; with our manager they would
    fail. Those entry points go through the manager instead.
    """

    _offload_manager: OffloadManager | None = None
    _prefetch: fast_read.Prefetch | None = None

    def _init_device_mesh(self):
        self.build_plan = build_plan(
            self.engine_config, self.optimizer_config, self.model_config.hf_config, _platform.detect()
        )
        # verl's configs are frozen and may be shared with other engines: this engine gets its own copy.
        otc, ddp = build.engine_overrides(self.build_plan, self.engine_config.override_ddp_config)
        self.engine_config = dataclasses.replace(
            self.engine_config, override_transformer_config=otc, override_ddp_config=ddp
        )
        build.enter_mindspeed(self.build_plan)
        logger.info("verl-npu engine build plan: %s", self.build_plan)
        super()._init_device_mesh()
        # the HF checkpoint is read once the model is built: its reads start now, while the model builds, where this
        # process reads all of it anyway (reading ahead more than the node loads would multiply the storage's traffic)
        if not self.engine_config.use_dist_checkpointing and loads_whole_checkpoint():
            skip = fast_read.unloaded_layers(self.model_config.hf_config)  # MTP layers the model does not build
            self._prefetch = fast_read.prefetch(self.model_config.local_path, skip)

    def _build_tf_config(self):
        super()._build_tf_config()
        if self.vanilla_bridge and build.adapt_bridge(self.bridge, self.build_plan):
            logger.info("verl-npu engine: %s builds on megatron-core's local spec", type(self.bridge).__name__)
        if self.vanilla_bridge and fast_load.bind_to(self.bridge):
            logger.info("verl-npu engine: %s loads HF checkpoints with parallel reads", type(self.bridge).__name__)
        if self.vanilla_bridge and fast_export.bind_to(self.bridge):
            logger.info("verl-npu engine: %s exports with the metadata exchanged once", type(self.bridge).__name__)

    def _build_megatron_module(self):
        try:
            module = super()._build_megatron_module()  # builds, then loads the HF checkpoint
        finally:
            if self._prefetch is not None:  # what the load did not claim is let go
                self._prefetch.close()
                self._prefetch = None
        build.adapt_module(self.bridge, module)
        return module

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        # verl's routing replay assumes packed rows; on the padded layout the router-replay-padded patch lays the
        # routes out, reading the micro-batch this forward runs (docs/router_replay.md)
        if not getattr(self, "enable_routing_replay", False) or self.engine_config.use_remove_padding:
            return super().forward_step(batch_iter, model, logits_processor_func, postprocess_micro_batch_func)
        with router_replay.padded_forward(batch_iter) as batches:
            return super().forward_step(batches, model, logits_processor_func, postprocess_micro_batch_func)

    def _offloader(self) -> OffloadManager:
        if self._offload_manager is None:
            # The device the state lives on (verl's device name says which accelerator type, not which one).
            device = next(p for chunk in self.module for p in chunk.parameters()).device
            self._offload_manager = OffloadManager(self.module, self.optimizer, device=device)
        return self._offload_manager

    def _resident(self, kinds: list[str]):
        """The manager's ``resident`` where there is a manager; without one nothing was ever offloaded."""
        if self._offload_manager is None:
            return contextlib.nullcontext()
        return self._offload_manager.resident(kinds)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        wanted = (("params", model), ("grads", grad and model), ("optimizer", optimizer and self.optimizer is not None))
        kinds = [kind for kind, on in wanted if on]
        if not kinds:
            # verl's initialize() calls this with nothing to move when offload is off: no manager, so no host arena
            # is pinned (pinning runs beside the passes that follow and slows their launches)
            return
        manager = self._offloader()
        if device == "cpu":
            manager.offload(kinds)
        elif device == get_device_name():
            manager.onload(kinds)
        else:
            raise ValueError(f"verl-npu engine: cannot move state to {device!r}; use 'cpu' or {get_device_name()!r}")

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        with self._resident(["params", "optimizer"]), save_staging.staged_in(self._idle_host_regions()):
            if self.optimizer is not None:
                ensure_torch_adam_state(self.optimizer)  # a save before the first step
            self.checkpoint_mananager.save_checkpoint(
                local_path=local_path, hdfs_path=hdfs_path, global_step=global_step, max_ckpt_to_keep=max_ckpt_to_keep
            )
            torch.distributed.barrier()

    def _idle_host_regions(self) -> list[torch.Tensor]:
        """Host arenas a synchronous save may stage in (the state is resident for the save, so all of them)."""
        config = self.checkpoint_mananager.checkpoint_config
        if self._offload_manager is None or (config and config.get("async_save", False)):
            return []  # an async save writes after returning, while the next offload fills the arenas again
        return self._offload_manager.idle_host_regions(["params", "optimizer"])

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        # Loading writes into the device storages; leaving ``resident`` copies the loaded values
        # back to the host arenas for whatever was offloaded before.
        with self._resident(["params", "optimizer"]):
            if self.optimizer is not None:
                ensure_torch_adam_state(self.optimizer)  # a fresh engine: resume in a new process
            self.checkpoint_mananager.load_checkpoint(
                local_path=local_path, hdfs_path=hdfs_path, del_local_after_load=del_local_after_load
            )
            if self.optimizer is not None and resync_torch_adam_steps(self.optimizer):
                logger.info("verl-npu engine: torch Adam step counts restored from the checkpoint")

    def get_per_tensor_param(self, *args, **kwargs):
        if self._offload_manager is not None:
            self._offload_manager.onload(["params"])  # verl's exporter reads the parameters on the device
        return super().get_per_tensor_param(*args, **kwargs)

    def get_per_tensor_param_shard(self, **kwargs):
        if self._offload_manager is not None:
            self._offload_manager.onload(["params"])
        return super().get_per_tensor_param_shard(**kwargs)


@EngineRegistry.register(model_type="language_model", backend="megatron", device=DEVICE, vendor=VENDOR)
class NPUMegatronEngineWithLMHead(NPUMegatronEngineMixin, MegatronEngineWithLMHead):
    """verl's Megatron LM engine with the verl-npu build plan and offload manager."""


@EngineRegistry.register(model_type="value_model", backend="megatron", device=DEVICE, vendor=VENDOR)
class NPUMegatronEngineWithValueHead(NPUMegatronEngineMixin, MegatronEngineWithValueHead):
    """verl's Megatron value engine with the verl-npu build plan and offload manager."""
