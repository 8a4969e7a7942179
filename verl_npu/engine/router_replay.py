"""MoE routing replay on the padded (BSHD) layout the engine runs DSA models on.

verl 0.9.1 records and replays routes (``router_replay.mode=R2|R3``) as per-sample jagged tensors, ``[tokens, layers,
topk]`` per sample, and lays them onto the routers' rows the way its packed (THD) forward does. With
``use_remove_padding=False`` (the only layout megatron-core 0.18's DSA takes) the model runs on
``preprocess_bshd_engine``'s padded ``[batch, seq]`` input, embedded as ``[seq, batch]``: router row ``r`` of a
micro-batch is position ``r // batch`` of sample ``r % batch`` (after the sequence-parallel split along positions,
and on a context-parallel rank its zigzag chunks). This module converts between the two by
``preprocess_bshd_engine``'s rule (:class:`PaddedLayout`), with the arguments the forward itself used, so the
routes follow the model's rows under any micro-batch split, dynamic batching, SP and CP. Padding rows are
not replayed: they keep the router's own choice, so no row is left with a duplicated or empty expert set.

The NPU engine (verl_npu.engine.verl_engine) marks each padded forward with :func:`padded_forward`; the runtime
patch ``router-replay-padded`` (verl_npu/runtime_patches/router_replay_padded.py) sends verl's record and replay
calls here inside such a forward and to verl's own code everywhere else. docs/router_replay.md has the whole story.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch

# The micro-batch the engine is forwarding on the padded layout, None elsewhere.
_PADDED_FORWARD: contextvars.ContextVar[_PaddedForward | None] = contextvars.ContextVar(
    "verl_npu_router_replay_padded_forward", default=None
)


@dataclasses.dataclass
class _PaddedForward:
    batch: Any = None  # the micro-batch TensorDict, once verl's forward_step has read it


class _ReadBatches:
    """verl's forward_step reads its micro-batch from this iterator; the record/replay calls read it back here."""

    def __init__(self, batches: Iterator[Any], state: _PaddedForward):
        self._batches, self._state = batches, state

    def __iter__(self):
        return self

    def __next__(self):
        self._state.batch = next(self._batches)
        return self._state.batch


@contextlib.contextmanager
def padded_forward(batches: Iterator[Any]):
    """For one verl ``forward_step`` on the padded layout: yields the iterator to hand it."""
    state = _PaddedForward()
    token = _PADDED_FORWARD.set(state)
    try:
        yield _ReadBatches(batches, state)
    finally:
        _PADDED_FORWARD.reset(token)


def current_padded_batch() -> Any | None:
    """The micro-batch of the padded forward in progress (None outside one, or before verl read it)."""
    state = _PADDED_FORWARD.get()
    return None if state is None else state.batch


# --- the layout ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PaddedLayout:
    """Where each token of a micro-batch lies in the padded forward on this rank.

    The rule is verl 0.9.1's ``preprocess_bshd_engine`` (verl/models/mcore/util.py), which pads the forward's
    input: every sample to the longest (or ``forced_max_seqlen``), aligned for SP and CP (and FP8 blocks), and
    under CP each rank holding chunks ``rank`` and ``2 * cp - 1 - rank`` of ``2 * cp``. It is computed here
    instead of called: on Ascend that function also builds a ``[batch, 1, seq, seq]`` attention mask, 1 GiB at
    32k tokens, for each call. tests_npu/engine/test_router_replay.py compares the two over TP, CP, FP8 and forced
    lengths."""

    lengths: tuple[int, ...]  # tokens of each sample
    forced_max_seqlen: int | None
    use_fp8_padding: bool
    tp_size: int = 1
    cp_size: int = 1
    cp_rank: int = 0

    @classmethod
    def of(cls, batch: Any, tf_config: Any) -> PaddedLayout:
        from megatron.core import parallel_state as mpu
        from verl.utils import tensordict_utils as tu

        input_ids = batch["input_ids"]
        if not input_ids.is_nested:
            raise RuntimeError(
                "verl-npu router replay: the padded forward's input_ids are not a jagged tensor "
                f"(found a dense {tuple(input_ids.shape)}); verl 0.9.1's engine hands micro-batches in NO_PADDING mode"
            )
        forced = tu.get_non_tensor_data(data=batch, key="forced_max_seqlen", default=None)
        return cls(
            lengths=tuple(int(n) for n in input_ids.offsets().diff().tolist()),
            forced_max_seqlen=None if forced is None else int(forced),
            use_fp8_padding=getattr(tf_config, "fp8", None) in ("e4m3", "hybrid"),
            tp_size=mpu.get_tensor_model_parallel_world_size(),
            cp_size=mpu.get_context_parallel_world_size(),
            cp_rank=mpu.get_context_parallel_rank(),
        )

    def padded_length(self) -> int:
        """The whole padded sequence length (before the CP split)."""
        longest = self.forced_max_seqlen if self.forced_max_seqlen is not None else max(self.lengths)
        align = self.tp_size * self.cp_size * 2 if self.cp_size > 1 else self.tp_size
        longest += (align - longest % align) % align
        if self.use_fp8_padding:
            blocks = 128 * self.tp_size * self.cp_size
            step = math.lcm(blocks // math.gcd(len(self.lengths), blocks), align)
            longest = -(-longest // step) * step
        return longest

    def positions(self, cp_rank: int | None = None) -> torch.Tensor:
        """The sequence positions a CP rank's padded rows hold, in row order."""
        longest = self.padded_length()
        if self.cp_size <= 1:
            return torch.arange(longest)
        rank = self.cp_rank if cp_rank is None else cp_rank
        chunk = longest // (2 * self.cp_size)
        first, second = rank * chunk, (2 * self.cp_size - rank - 1) * chunk
        return torch.cat((torch.arange(first, first + chunk), torch.arange(second, second + chunk)))

    def token_index(self, cp_rank: int | None = None) -> torch.Tensor:
        """``[batch, seq]``: each padded row's index among the micro-batch's tokens (samples one after another),
        -1 on padding."""
        positions = self.positions(cp_rank).unsqueeze(0)
        lengths = torch.tensor(self.lengths).unsqueeze(1)
        starts = self.token_offsets()[:-1].unsqueeze(1)
        return torch.where(positions < lengths, starts + positions, torch.full_like(positions, -1))

    def token_offsets(self) -> torch.Tensor:
        return torch.tensor([0, *self.lengths], dtype=torch.int64).cumsum(0)

    def valid(self) -> torch.Tensor:
        """``[batch, seq]`` bool: True where this rank's padded row holds a real token."""
        return self.token_index() >= 0

    def pad(self, per_sample: torch.Tensor) -> torch.Tensor:
        """A jagged ``[batch, tokens, ...]`` tensor as this rank's padded ``[batch, seq, ...]`` (zeros on padding)."""
        found = tuple(int(n) for n in per_sample.offsets().diff().tolist())
        if found != self.lengths:
            raise RuntimeError(
                "verl-npu router replay: the routes do not cover the micro-batch's tokens: expected per-sample "
                f"lengths {list(self.lengths)} (input_ids), found {list(found)} (routed_experts / replay mask)"
            )
        values = per_sample.values()
        index = self.token_index().to(values.device)
        padded = values.new_zeros((*index.shape, *values.shape[1:]))
        real = index >= 0
        padded[real] = values[index[real]]
        return padded

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """This rank's padded ``[batch, seq, ...]`` rows as the jagged per-sample tensor of every token
        (context-parallel ranks gather their chunks)."""
        parts = [padded]
        if self.cp_size > 1:
            from megatron.core import parallel_state as mpu

            parts = [torch.empty_like(padded) for _ in range(self.cp_size)]
            torch.distributed.all_gather(parts, padded.contiguous(), group=mpu.get_context_parallel_group())
        values = padded.new_zeros((sum(self.lengths), *padded.shape[2:]))
        for rank, part in enumerate(parts):
            index = self.token_index(rank).to(padded.device)
            real = index >= 0
            values[index[real]] = part[real]
        return torch.nested.nested_tensor_from_jagged(values, offsets=self.token_offsets().to(padded.device))


def _sequence_parallel(tf_config: Any) -> bool:
    from megatron.core import parallel_state as mpu

    return bool(getattr(tf_config, "sequence_parallel", False)) and mpu.get_tensor_model_parallel_world_size() > 1


def rows_to_samples(rows: torch.Tensor, layout: PaddedLayout, tf_config: Any) -> torch.Tensor:
    """Router rows ``[rows, ...]`` of one micro-batch (this rank's SP part) -> jagged ``[batch, tokens, ...]``."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    if _sequence_parallel(tf_config):
        rows = gather_from_sequence_parallel_region(rows, tensor_parallel_output_grad=False)
    batch, seq = len(layout.lengths), len(layout.positions())
    if rows.shape[0] != seq * batch:
        raise RuntimeError(
            "verl-npu router replay: the routers saw a different token layout than the padded forward: "
            f"expected {seq} positions x {batch} samples = {seq * batch} rows, found {rows.shape[0]}"
        )
    return layout.unpad(rows.reshape(seq, batch, *rows.shape[1:]).transpose(0, 1).contiguous())


def samples_to_rows(per_sample: torch.Tensor, layout: PaddedLayout, tf_config: Any, device: Any) -> torch.Tensor:
    """Jagged ``[batch, tokens, ...]`` -> this rank's router rows ``[rows, ...]`` (position-major, SP-split)."""
    return padded_to_rows(layout.pad(per_sample), tf_config, device)


def padded_to_rows(padded: torch.Tensor, tf_config: Any, device: Any) -> torch.Tensor:
    """This rank's padded ``[batch, seq, ...]`` -> its router rows ``[rows, ...]`` (position-major, SP-split)."""
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    rows = padded.transpose(0, 1).reshape(-1, *padded.shape[2:]).to(device)
    if _sequence_parallel(tf_config):
        rows = scatter_to_sequence_parallel_region(rows)
    return rows


# --- record and replay -----------------------------------------------------------------------------------------


def record(routers: list[Any], layout: PaddedLayout, tf_config: Any, device: Any) -> torch.Tensor:
    """The routes ``routers`` (one per local MoE layer, in layer order) recorded in this micro-batch's forward,
    as verl keeps them: jagged int16 ``[batch, tokens, layers, topk]`` on the CPU."""
    stacked = torch.stack([router.recorded_topk_idx.to(torch.int16) for router in routers], dim=1)
    # collectives carry no int16 (NCCL/HCCL): travel as bytes, reinterpret afterwards
    as_bytes = stacked.to(device).contiguous().view(torch.uint8)
    per_sample = rows_to_samples(as_bytes, layout, tf_config)
    values = per_sample.values().contiguous().view(torch.int16)
    return torch.nested.nested_tensor_from_jagged(values.cpu(), offsets=per_sample.offsets().cpu())


def replay_targets(
    routes: torch.Tensor, replay_mask: torch.Tensor | None, layout: PaddedLayout, tf_config: Any, device: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets ``[rows, layers, topk]`` int64, replay mask ``[rows]`` bool) on this rank's router rows.

    A row is replayed where it holds a real token that ``replay_mask`` (R3's) selects; padding rows and the
    rows R3 leaves out keep the router's own choice."""
    targets = samples_to_rows(routes, layout, tf_config, device).to(torch.int64)
    keep = layout.valid()
    if replay_mask is not None:
        keep = keep & layout.pad(replay_mask).bool()
    return targets, padded_to_rows(keep, tf_config, device)
