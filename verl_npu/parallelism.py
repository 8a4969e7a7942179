"""One Megatron role's parallelism, without torch: the one record that preflight's mesh check, its memory and
start-up estimates and the engine's build plan read.

The sizes are megatron-core 0.18's (``parallel_state.initialize_model_parallel``): the data-parallel size is
world / (TP x PP x CP) and the expert data-parallel size world / (PP x EP x ETP), each asserted to divide; ranks
are ordered "tp-cp-ep-dp-pp", so the pipeline stage is the outermost coordinate; the layers of each stage are
megatron's split (:mod:`verl_npu.pipeline_split`). :meth:`Parallelism.problems` lists every size megatron (or
TransformerConfig's sequence-parallel rule, or the model's experts) would refuse, each with how to fix it.
tests_npu/test_parallelism.py checks the sizes and the rank order against megatron-core's own where it is installed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from verl_npu.pipeline_split import PipelineSplitError, stage_layers

# the ids of the problems (preflight's mesh check reports each as mesh.<role>-<id>); the layer split's are
# verl_npu.pipeline_split's PP_LAYERS and VPP_LAYERS
DP, EP, EP_EXPERTS, EP_DENSE, SP = "dp", "ep", "ep-experts", "ep-dense", "sp"


@dataclasses.dataclass(frozen=True)
class SizeProblem:
    check: str  # one of the ids above, or the layer split's
    message: str  # the sizes involved and how to fix them


class ParallelismError(ValueError):
    """Sizes megatron would refuse: every problem at once."""

    def __init__(self, problems: Sequence[SizeProblem]):
        self.problems = tuple(problems)
        super().__init__("; ".join(p.message for p in self.problems))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parallelism:
    """A role's process-group sizes over ``world`` devices and its pipeline's layer split.

    ``world`` is None where the device count is not known (the engine's build plan is a function of the configs
    alone): the model-parallel sizes and the layer split are there, the data-parallel sizes and rank order are not.
    """

    world: int | None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1  # expert_tensor_parallel_size (a launch's null is TP, as megatron-core defaults it)
    sequence_parallel: bool = False
    vpp: int | None = None  # virtual_pipeline_model_parallel_size
    first_stage_layers: int | None = None  # num_layers_in_first_pipeline_stage
    last_stage_layers: int | None = None  # num_layers_in_last_pipeline_stage

    @property
    def devices(self) -> int:
        """``world``, or ParallelismError where the record has none."""
        if self.world is None:
            lacks = "the data-parallel sizes and the rank order need the world size, which this record lacks"
            raise ParallelismError([SizeProblem(DP, f"{lacks}; build it with world=nnodes x n_gpus_per_node")])
        return self.world

    @property
    def model_parallel(self) -> int:
        """TP x PP x CP: the devices of one data-parallel replica."""
        return self.tp * self.pp * self.cp

    @property
    def expert_parallel(self) -> int:
        """PP x EP x ETP: the devices of one expert data-parallel replica."""
        return self.pp * self.ep * self.etp

    @property
    def dp(self) -> int:
        """World / (TP x PP x CP), rounded down as megatron computes it (exact unless :meth:`problems` has DP)."""
        return self.devices // self.model_parallel

    @property
    def expert_dp(self) -> int:
        """World / (PP x EP x ETP), rounded down (exact unless :meth:`problems` has EP)."""
        return self.devices // self.expert_parallel

    @property
    def ranks_per_stage(self) -> int:
        return self.devices // self.pp

    def stage_of_rank(self, rank: int) -> int:
        """The pipeline stage of global rank ``rank``: megatron's order "tp-cp-ep-dp-pp" puts PP outermost."""
        return rank // self.ranks_per_stage

    def stage_layers(self, num_layers: int) -> list[int]:
        """The decoder layers of each stage: megatron's split, PipelineSplitError (a ValueError) where it has none."""
        return stage_layers(num_layers, self.pp, self.first_stage_layers, self.last_stage_layers, self.vpp)

    def problems(self, num_layers: int | None = None, num_experts: int | None = None) -> list[SizeProblem]:
        """Every size megatron would refuse: the world's split (when ``world`` is known), the experts' (when
        ``num_experts`` is given: 0 for a dense model), sequence parallelism, and the layers' (when ``num_layers``)."""
        found: list[SizeProblem] = []
        add = lambda check, message: found.append(SizeProblem(check, message))  # noqa: E731
        world, tp, pp, cp, ep, etp = self.world, self.tp, self.pp, self.cp, self.ep, self.etp
        if world is not None and world % self.model_parallel:
            add(DP, f"world size {world} is not divisible by TP {tp} x PP {pp} x CP {cp} = {self.model_parallel}; "
                    "choose TP, PP and CP whose product divides the world size (nnodes x n_gpus_per_node)")  # fmt: skip
        if world is not None and world % self.expert_parallel:
            add(EP, f"world size {world} is not divisible by PP {pp} x EP {ep} x ETP {etp} = {self.expert_parallel} "
                    "(the expert-parallel group); choose an expert_model_parallel_size and expert_tensor_parallel_size "
                    "whose product with PP divides the world size")  # fmt: skip
        if num_experts and num_experts % ep:
            add(EP_EXPERTS, f"EP {ep} does not divide the model's {num_experts} routed experts; use an "
                            "expert_model_parallel_size that divides them")  # fmt: skip
        if num_experts == 0 and ep > 1:
            add(EP_DENSE, f"EP {ep} on a dense model (no routed experts); set expert_model_parallel_size=1")
        if self.sequence_parallel and tp == 1:
            add(SP, "sequence_parallel=True needs tensor_model_parallel_size > 1 (TP is 1); drop sequence_parallel")
        if num_layers is not None:
            try:
                self.stage_layers(num_layers)
            except PipelineSplitError as exc:
                add(exc.check, str(exc))
        return found

    def validate(self, num_layers: int | None = None, num_experts: int | None = None) -> None:
        """Raise ParallelismError naming every problem (:meth:`problems`)."""
        if found := self.problems(num_layers, num_experts):
            raise ParallelismError(found)
