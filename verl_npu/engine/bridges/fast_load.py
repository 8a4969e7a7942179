"""An mbridge bridge's HF checkpoint load, at the disk's rate: one state dict per model, parallel reads, FP8 on device.

What it changes, against mbridge 0.15.1's ``Bridge.load_weights`` (``mbridge/core/bridge.py``), whose decisions it
keeps (which rank reads which tensor, the bridge's own name mapping and format hooks, the TP / expert-TP scatter):

- mbridge calls ``model.state_dict()`` once per parameter (a walk of the whole module tree each time) and intersects
  the list of names to read with each parameter's: quadratic in the number of tensors. Here: once per model chunk.
- mbridge reads through ``safe_open``, one tensor at a time from a memory map, before it converts any; here each
  tensor is its own read on verl_npu.engine.bridges.fast_read's threads (``TensorReads``), issued in the order the
  parameters are loaded (or claimed from the engine's prefetch, which starts them while the model is built), copied
  to the device on several threads ahead of the load, and each parameter is converted as soon as its tensors are
  there, while the next ones are read and copied.
- An FP8 block-scaled checkpoint (verl_npu.engine.bridges.fp8_safetensors) is dequantised on the device, one
  parameter at a time: codes and scales cross the bus as stored (1 byte per weight, not 2) and the float32 products
  are the device's, bit for bit those of the host (IEEE multiplication, one rounding to bf16).
- A scatter over a group of one rank is a copy: it is skipped.

Measured on the nvidia-h200 (docs/rl_step.md): mbridge's load of a 3.1 GB dense model took 3.8 s, 42% of that
machine's disk rate. The loaded parameters are bit-identical to mbridge's (tests_npu/engine/test_fast_load.py).

Used for a bridge whose reader is mbridge's ``SafeTensorIO`` or one of this package's (verl_npu.engine.bridges); any
other reader transforms what it reads in its own way, and that bridge keeps mbridge's loader.

Remove when mbridge's loader reads in parallel and builds one state dict per model.
"""

from __future__ import annotations

import collections
import functools
import logging
import time

import torch
from mbridge.core.safetensor_io import SafeTensorIO

from verl_npu.engine.bridges.fast_read import (
    ParallelSafeTensorIO,
    TensorReads,
    file_of_name,
)
from verl_npu.engine.bridges.fp8_safetensors import SCALE_SUFFIX, BlockFP8SafeTensorIO, dequantize

logger = logging.getLogger(__name__)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_EMBEDDINGS = ("lm_head.weight", "model.embed_tokens.weight")


def takes(reader: object) -> bool:
    """Whether this loader reads what ``reader`` would: mbridge's plain reader or this package's."""
    return type(reader) is SafeTensorIO or isinstance(reader, ParallelSafeTensorIO)


def names_for_device(reader: SafeTensorIO, names: list[str]) -> list[str]:
    """``names`` and, where ``reader`` dequantises (to_device), the block scales of FP8 ones."""
    if isinstance(reader, BlockFP8SafeTensorIO):
        known = file_of_name(reader)
        return [*names, *(n + SCALE_SUFFIX for n in names if n + SCALE_SUFFIX in known)]
    return list(names)


def to_device(name: str, raw: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """``raw[name]`` on ``device``; an FP8 weight dequantised there with its block scale."""
    tensor = raw[name]
    if tensor.dtype in _FP8:
        scale = raw.get(name + SCALE_SUFFIX)
        if scale is None:
            raise ValueError(f"FP8 checkpoint: no {SCALE_SUFFIX} for {name}")
        return dequantize(tensor.to(device), scale.to(device))
    return tensor.to(device)


def take_to_device(reads: TensorReads, reader: SafeTensorIO, hf_names: list[str], device: torch.device):
    """The HF tensors ``hf_names`` taken from ``reads`` (with their block scales where ``reader`` dequantises), on
    ``device``, FP8 ones dequantised there (:func:`to_device`)."""
    raw = {n: reads.take(n) for n in dict.fromkeys(names_for_device(reader, hf_names))}
    return [to_device(n, raw, device) for n in hf_names]


def load_weights(bridge, models: list[torch.nn.Module], weights_path: str, memory_efficient: bool = False) -> None:
    """``bridge.load_weights(models, weights_path)``, faster (module docstring). ``memory_efficient`` is accepted
    for mbridge's signature: the host holds at most one model chunk's tensors (those read and not yet loaded)."""
    reader = bridge._get_safetensor_io(weights_path)
    if not takes(reader):
        from mbridge.core.bridge import Bridge

        logger.info("verl-npu: %s reads with %s: mbridge's loader", type(bridge).__name__, type(reader).__name__)
        Bridge.load_weights(bridge, models, weights_path, memory_efficient)
        return
    bridge.safetensor_io = reader
    mpu = bridge.mpu
    for model in models:
        local_to_global = bridge._weight_name_mapping_mcore_local_to_global(model)
        local_to_hf = {
            local: bridge._weight_name_mapping_mcore_to_hf(name)
            for local, name in local_to_global.items()
            if "_extra_state" not in local
        }
        readers_of = {}  # local name -> whether this rank reads its tensors (mbridge's rule)
        for local, hf_names in local_to_hf.items():
            if ".mlp.experts.linear_fc" in local:
                readers_of[local] = mpu.etp_rank == 0
            else:
                readers_of[local] = mpu.tp_rank == 0 or "lm_head.weight" in hf_names
        read_here = {n for local, hf in local_to_hf.items() if readers_of[local] for n in hf}
        # in the order the loop below takes them, each as many times as it is taken (tied embeddings: twice)
        uses = collections.Counter(
            n for hf in local_to_hf.values() if read_here.intersection(hf) for n in names_for_device(reader, hf)
        )
        started = time.perf_counter()
        device = next((p.device for p in model.parameters()), None)  # the copies there run ahead of the load
        with TensorReads(reader, list(uses), uses, device) as reads:
            _load_chunk(bridge, model, local_to_hf, read_here, reads, mpu)
        logger.info("verl-npu: loaded %d checkpoint bytes in %.2f s", reads.nbytes, time.perf_counter() - started)


def _load_chunk(bridge, model, local_to_hf: dict[str, list[str]], read_here: set[str], reads: TensorReads, mpu) -> None:
    """Each parameter as soon as its tensors are read: the device copies of one overlap the reads of the next."""
    state = model.state_dict()
    for local, hf_names in local_to_hf.items():
        param = state[local]
        mcore_weight = None
        if read_here.intersection(hf_names):
            hf_weights = take_to_device(reads, bridge.safetensor_io, hf_names, param.device)
            mcore_weight = bridge._weight_to_mcore_format(local, hf_weights)
            del hf_weights
        if hf_names[0] in _EMBEDDINGS and param.shape[0] == 1 and (mcore_weight is None or mcore_weight.shape[0] != 1):
            continue  # a value model's one-row head: not the checkpoint's
        expert = ".mlp.experts.linear_fc" in local
        group, size = (mpu.etp_group, mpu.etp_size) if expert else (mpu.tp_group, mpu.tp_size)
        shards = None
        if (mpu.etp_rank if expert else mpu.tp_rank) == 0:
            split = bridge._weight_split_across_tp(local, mcore_weight, param, size)
            shards = [t.to(param.device, dtype=param.dtype).contiguous() for t in split]
        if size == 1:
            param.copy_(shards[0])
            continue
        received = torch.empty_like(param)
        source = torch.distributed.get_global_rank(group, 0)
        torch.distributed.scatter(received, shards, src=source, group=group)
        param.copy_(received)


def bind_to(bridge) -> bool:
    """Give an mbridge bridge that loads with mbridge's own ``Bridge.load_weights`` this loader (on the instance:
    verl's engine calls ``bridge.load_weights``). A bridge class with a loader of its own keeps it (GLM5Bridge
    calls this one itself). True when bound."""
    from mbridge.core.bridge import Bridge

    if getattr(type(bridge), "load_weights", None) is not Bridge.load_weights:
        return False
    bridge.load_weights = functools.partial(load_weights, bridge)
    return True
