"""IndexShare (GLM-5.2's shared DSA top-k) through forward passes, activation recompute and pipeline stages.

The layers themselves come from verl_npu.engine.index_share (a full layer publishes the top-k its
sparse attention ran with, a shared layer reads the latest); these patches give that carry its
scope, on megatron-core 0.18, which computes a top-k in every DSA layer:

* ``dsa-index-share-forward`` wraps ``TransformerBlock.forward``: each forward pass of a block built
  with IndexShare layers gets a fresh carry (starting with the top-k received from the previous
  pipeline stage when this stage begins on a shared layer) and, when the next stage begins on a
  shared layer, leaves the forward's latest top-k to send. No top-k outlives its forward pass, so
  none leaks into another micro-batch.
* ``dsa-index-share-recompute`` wraps ``tensor_parallel.checkpoint`` (full activation recompute, and
  every selective-recompute module megatron checkpoints with it): a chunk's recomputation in
  backward runs with the carry its forward started with.
* ``dsa-index-share-pipeline-*`` wrap the non-interleaved schedule's P2P calls that move activations
  forward: after the activations, the sending stage sends a [b, s, k] header and the top-k (int32)
  to the next stage, which queues it for its forward. Interleaved pipelines are refused by the build
  plan.
* ``dsa-index-share-mindspeed-*`` (Ascend, MindSpeed's fused DSA path) report the top-k MindSpeed's
  sparse-attention operator runs with, as verl-npu's own sparse attention does.

Upstream: megatron-core 0.18.0 transformer/transformer_block.py (TransformerBlock.forward),
tensor_parallel/random.py (checkpoint), pipeline_parallel/p2p_communication.py (P2PCommunicator);
MindSpeed core_r0.18.0 transformer/experimental_attention_variant/dsa_npu_fused.py,
dsa_kvallgather_context_parallel.py.
Remove when: megatron-core shares DSA top-k across layers itself (added upstream after core 0.18).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TypedDict

from verl_npu.engine import index_share
from verl_npu.patching import Patch
from verl_npu.runtime_patches._targets import EVERY_PLATFORM, MEGATRON_CORE

REMOVE_WHEN = "megatron-core shares DSA top-k across layers (IndexShare) itself"


def _block_forward(original):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        plan = index_share.block_plan(self)
        if plan is None:
            return original(self, *args, **kwargs)
        pipelined = _pipelined()
        registered = index_share.current_stage()
        if pipelined and registered != plan:
            raise index_share.IndexShareError(
                f"this decoder block holds layers {plan.layers}, but the pipeline carry was set up for "
                f"{registered.layers if registered else 'no IndexShare model'}"
            )
        incoming = index_share.take_received(plan) if plan.receives and pipelined else None
        with index_share.forward_scope(incoming) as carry:
            output = original(self, *args, **kwargs)
        if plan.sends and pipelined:
            if carry.latest is None:
                index_share.take_to_send(plan)  # raises: nothing to send
            index_share.to_send(carry.latest)
        return output

    return forward


def _pipelined() -> bool:
    from megatron.core import parallel_state

    return (
        parallel_state.model_parallel_is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1
    )


def _checkpoint(original):
    @functools.wraps(original)
    def checkpoint(function, distribute_saved_activations, *args):
        return original(index_share.recompute_safe(function), distribute_saved_activations, *args)

    return checkpoint


# --- pipeline P2P --------------------------------------------------------------------------------------


def _send_topk(communicator, reference, plan: index_share.StagePlan) -> None:
    import torch
    import torch.distributed as dist

    topk = index_share.take_to_send(plan)
    header = torch.tensor(topk.shape, dtype=torch.int64, device=reference.device)
    dist.send(header, dst=communicator.next_rank, group=communicator.pp_group)
    dist.send(topk.to(device=reference.device, dtype=torch.int32).contiguous(), dst=communicator.next_rank,
              group=communicator.pp_group)  # fmt: skip


def _recv_topk(communicator, reference) -> None:
    import torch
    import torch.distributed as dist

    header = torch.empty(3, dtype=torch.int64, device=reference.device)
    dist.recv(header, src=communicator.prev_rank, group=communicator.pp_group)
    topk = torch.empty(tuple(header.tolist()), dtype=torch.int32, device=reference.device)
    dist.recv(topk, src=communicator.prev_rank, group=communicator.pp_group)
    index_share.received(topk.long())


def _sending_plan(is_last_stage: bool) -> index_share.StagePlan | None:
    """This stage's plan when it sends its top-k on to the next stage, else None."""
    plan = index_share.current_stage()
    return plan if plan is not None and plan.sends and not is_last_stage else None


def _stage_receives(is_first_stage: bool) -> bool:
    plan = index_share.current_stage()
    return plan is not None and plan.receives and not is_first_stage


def _first(tensors):
    return tensors[0] if isinstance(tensors, list) else tensors


def _send_forward(original):
    @functools.wraps(original)
    def send_forward(self, output_tensors, is_last_stage):
        result = original(self, output_tensors, is_last_stage)
        if (plan := _sending_plan(is_last_stage)) is not None:
            _send_topk(self, _first(output_tensors), plan)
        return result

    return send_forward


def _send_forward_recv_backward(original):
    @functools.wraps(original)
    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage):
        result = original(self, output_tensors, tensor_shapes, is_last_stage)
        if (plan := _sending_plan(is_last_stage)) is not None:
            _send_topk(self, _first(output_tensors), plan)
        return result

    return send_forward_recv_backward


def _recv_forward(original):
    @functools.wraps(original)
    def recv_forward(self, tensor_shapes, is_first_stage):
        result = original(self, tensor_shapes, is_first_stage)
        if _stage_receives(is_first_stage):
            _recv_topk(self, _first(result))
        return result

    return recv_forward


def _send_backward_recv_forward(original):
    @functools.wraps(original)
    def send_backward_recv_forward(self, input_tensor_grads, tensor_shapes, is_first_stage):
        result = original(self, input_tensor_grads, tensor_shapes, is_first_stage)
        if _stage_receives(is_first_stage):
            _recv_topk(self, _first(result))
        return result

    return send_backward_recv_forward


# --- MindSpeed's fused DSA path (Ascend) ---------------------------------------------------------------


def _reports_topk(position: int):
    def build(original):
        @functools.wraps(original)
        def sparse_attention(*args, **kwargs):
            index_share.publish(args[position] if len(args) > position else kwargs["topk_indices"])
            return original(*args, **kwargs)

        return sparse_attention

    return build


P2P = "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator"
MS_DSA = "mindspeed.core.transformer.experimental_attention_variant"


class _SharedFields(TypedDict):
    """What a group of this module's patches declare alike."""

    kind: str
    platforms: frozenset[str]
    requires: Mapping[str, str]
    reason: str
    remove_when: str


_PIPELINE = _SharedFields(
    kind="wrap",
    platforms=EVERY_PLATFORM,
    requires=MEGATRON_CORE,
    reason="a pipeline stage that begins with a shared DSA layer needs the previous stage's latest top-k for each "
    "micro-batch; it is sent after the activations",
    remove_when=REMOVE_WHEN,
)
_MINDSPEED = _SharedFields(
    kind="wrap",
    platforms=frozenset({"ascend"}),
    requires=MEGATRON_CORE,
    reason="on MindSpeed's fused DSA path a full layer's top-k reaches the sparse-attention operator, not verl-npu's "
    "sparse attention: it is reported from there for the shared layers after it",
    remove_when=REMOVE_WHEN,
)

PATCHES = (
    Patch(
        id="dsa-index-share-forward",
        target="megatron.core.transformer.transformer_block:TransformerBlock.forward",
        kind="wrap",
        platforms=EVERY_PLATFORM,
        requires=MEGATRON_CORE,
        source_sha256="c77479d9a9f03360543589d72a3d316e0331b3c0ea41bf6eb34e35c0a8733f58",
        reason="GLM-5.2's shared DSA layers reuse the most recent full layer's top-k (megatron-core 0.18 computes "
        "one in every layer); each forward pass gets its own top-k carry, so none leaks across micro-batches",
        upstream="megatron-core 0.18.0 transformer/transformer_block.py::TransformerBlock.forward",
        remove_when=REMOVE_WHEN,
        build=_block_forward,
    ),
    Patch(
        id="dsa-index-share-recompute",
        target="megatron.core.tensor_parallel:checkpoint",
        kind="wrap",
        platforms=EVERY_PLATFORM,
        requires=MEGATRON_CORE,
        source_sha256="1d01f06366660e94c3a79dcbea0324cabc36c433568e19c487e541e5cef0d625",
        reason="a shared DSA layer recomputed in backward must read the top-k its forward read, not one published "
        "later; a checkpointed chunk recomputes with the carry it started with",
        upstream="megatron-core 0.18.0 tensor_parallel/random.py::checkpoint",
        remove_when=REMOVE_WHEN,
        build=_checkpoint,
    ),
    Patch(
        id="dsa-index-share-pipeline-send-forward",
        target=f"{P2P}.send_forward",
        source_sha256="55817eda16ca73149a0bfc7dd710d0e50128db8e7d4ada6aa6db8f8142b4265f",
        upstream="megatron-core 0.18.0 pipeline_parallel/p2p_communication.py::P2PCommunicator.send_forward",
        build=_send_forward,
        **_PIPELINE,
    ),
    Patch(
        id="dsa-index-share-pipeline-send-forward-recv-backward",
        target=f"{P2P}.send_forward_recv_backward",
        source_sha256="d8a9f648bffcbe8116df7397dd735fe5b530751612d6f096771edc002298e18f",
        upstream="megatron-core 0.18.0 pipeline_parallel/p2p_communication.py::P2PCommunicator."
        "send_forward_recv_backward",
        build=_send_forward_recv_backward,
        **_PIPELINE,
    ),
    Patch(
        id="dsa-index-share-pipeline-recv-forward",
        target=f"{P2P}.recv_forward",
        source_sha256="22be7e036898bfdc72d0222f3c8ffb7193655661dce12cd8e7b0cf3d885a9f99",
        upstream="megatron-core 0.18.0 pipeline_parallel/p2p_communication.py::P2PCommunicator.recv_forward",
        build=_recv_forward,
        **_PIPELINE,
    ),
    Patch(
        id="dsa-index-share-pipeline-send-backward-recv-forward",
        target=f"{P2P}.send_backward_recv_forward",
        source_sha256="0d9b661c4c58dd89a5deef414f0b84f7929150fd976c4b4d999efba4d9ede1b4",
        upstream="megatron-core 0.18.0 pipeline_parallel/p2p_communication.py::P2PCommunicator."
        "send_backward_recv_forward",
        build=_send_backward_recv_forward,
        **_PIPELINE,
    ),
    Patch(
        id="dsa-index-share-mindspeed-sparse-attention",
        target=f"{MS_DSA}.dsa_npu_fused:fused_npu_sparse_flash_attention",
        source_sha256="3bdf7cfffaf4a02b5dd440d706653749696ae50e0ac3181cb19325704fc38c2d",
        upstream="MindSpeed core_r0.18.0 transformer/experimental_attention_variant/dsa_npu_fused.py::"
        "fused_npu_sparse_flash_attention",
        build=_reports_topk(3),
        **_MINDSPEED,
    ),
    Patch(
        id="dsa-index-share-mindspeed-sparse-attention-cp",
        target=f"{MS_DSA}.dsa_kvallgather_context_parallel:fused_npu_sparse_flash_attention_kvallgather",
        source_sha256="b6239721492e6044b1e01212acecce0f6297f8daba21dc8452b9fcd6d4a4be4a",
        upstream="MindSpeed core_r0.18.0 transformer/experimental_attention_variant/dsa_kvallgather_context_parallel"
        ".py::fused_npu_sparse_flash_attention_kvallgather",
        build=_reports_topk(3),
        **_MINDSPEED,
    ),
)
