"""One-process torch.distributed and megatron model-parallel state: a parity run, the tests and the benchmarks.

megatron-core needs a process group even for one rank; it opens one on a free local port. ``backend`` is gloo on
CPU, nccl on CUDA, hccl on Ascend.
"""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(backend: str, device_index: int | None = None) -> None:
    """A world of one rank on ``backend`` (``device_index``: the accelerator it uses), then megatron's parallel
    state with every size 1; each part only when it is not initialised yet."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        if device_index is not None:
            if backend == "hccl":
                torch.npu.set_device(device_index)
            else:
                torch.cuda.set_device(device_index)
        dist.init_process_group(backend, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
