"""megatron-core 0.18's split of a model's decoder layers over pipeline stages, without torch: the one copy that the
engine's build plan, preflight's mesh check, its memory model and its start-up estimate read.

The rules are megatron's own: ``TransformerConfig.__post_init__`` refuses uneven first/last stages that leave the
middle stages without layers (or layers without middle stages), that do not divide the middle layers evenly or into
the virtual pipeline's chunks, and non-positive end stages; ``get_num_layers_to_build``
(megatron/core/transformer/transformer_block.py) asserts that an even split divides by PP and each stage by VPP.
One rule is ours, stricter than megatron: first/last-stage counts with PP 1 are refused (megatron builds the
first-stage count, whatever the model has). tests_npu/test_pipeline_split.py checks this function against megatron's
on every case of a property test.
"""

from __future__ import annotations

PP_LAYERS, VPP_LAYERS = "pp-layers", "vpp-layers"  # the mesh check's ids for the two kinds of refusal


class PipelineSplitError(ValueError):
    """Layers that megatron cannot split this way; ``check`` says whether the pipeline or its virtual chunks."""

    def __init__(self, message: str, check: str = PP_LAYERS):
        super().__init__(message)
        self.check = check


def stage_layers(
    num_layers: int, pp: int, first: int | None = None, last: int | None = None, vpp: int | None = None
) -> list[int]:
    """The decoder layers of each pipeline stage, in stage order (each stage's over all its virtual chunks)."""
    if pp == 1:
        if first is not None or last is not None:
            raise PipelineSplitError(
                "num_layers_in_first/last_pipeline_stage are set but PP is 1; drop them or raise PP"
            )
        return [num_layers]
    chunks = vpp or 1
    if first is None and last is None:
        if num_layers % pp:
            raise PipelineSplitError(f"{num_layers} layers over PP {pp} do not split evenly; change PP")
        if (num_layers // pp) % chunks:
            raise PipelineSplitError(
                f"{num_layers // pp} layers per stage do not divide into VPP {vpp} chunks", VPP_LAYERS
            )
        return [num_layers // pp] * pp
    for count, which in ((first, "first"), (last, "last")):
        if count is not None and count <= 0:
            raise PipelineSplitError(f"num_layers_in_{which}_pipeline_stage={count}: a stage needs at least 1 layer")
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    split = f"{num_layers} layers - {first or 0} (first stage) - {last or 0} (last stage) = {rest} over {middle} stages"
    if rest < 0 or bool(rest) != bool(middle) or (middle and rest % middle):
        raise PipelineSplitError(
            f"{split} do not split evenly (every middle stage needs the same number, at least 1); change PP or the "
            "first/last-stage layer counts"
        )
    each = rest // middle if middle else 0
    if middle and each % chunks:
        raise PipelineSplitError(f"{each} layers per stage do not divide into VPP {vpp} chunks", VPP_LAYERS)
    odd = [(n, w) for n, w in ((first, "first"), (last, "last")) if n is not None and n % chunks]
    if odd:
        ends = " and ".join(f"{n} layers on the {w} stage" for n, w in odd)
        raise PipelineSplitError(f"{ends} do not divide into VPP {vpp} chunks (megatron-core refuses them)", VPP_LAYERS)
    return [first if first is not None else each, *[each] * (pp - 2), last if last is not None else each]
