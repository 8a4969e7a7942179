"""Fault detection (issue 30): each injected fault (tests_npu/support/parity_injections.py: the five upstream
mismatches and the porting faults) fails the nightly's judgement and is named at its module, block by block.

Per fault, as ci/nightly/parity.sh judges a node (and bench/parity_faults.py measures):

- ``fp32-vs-cuda``: the fault's fp32 run, each block fed the CUDA reference's fp32 inputs, judged against the
  reference (``--replay-from`` the reference);
- ``bf16-vs-own-fp32``: the fault's bf16 run, each block fed the fault's fp32 run's inputs (the node's fp32 run has
  the fault too), judged against that run with the reference's measured bf16 error (``--precise``).

The nightly fails when either fails; the module named is the first failing mode's first block out of tolerance.
The full table is marked ``slow`` (40 job runs); the default tier judges one fault of each kind (attention, MoE
router, bf16 only, dense) with the same assertions, one job run each: the bf16 mode is run only where the fp32 mode
passes (the nightly fails at the first). Every run is the session's (``parity_runs``); two of them are
tests_npu/parity/test_parity.py's as well.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("mbridge", reason="the parity job builds through mbridge; not installed here")

from support import parity_injections
from support.parity_runs import CPU_MODELS

from verl_npu.parity import compare as cmp
from verl_npu.parity.cli import DEFAULT_REFERENCE

ATTENTION_0 = "mb0/layers.0.self_attention"
MOE = "mb0/layers.3.mlp"  # layer 3: GLM-5.2's first MoE layer
# fault -> (the model it lives in, the block the nightly names), as bench/parity_faults.py measured on the CPU
# (docs/parity.md's table): a fault inside layer N's attention (indexer, RoPE, masks, norms, scale) is named at
# layer N's attention block; a router or MoE fault at layer 3's MLP; a dense model's fault at its layer 0 attention.
FAULTS = {
    "k_norm_eps": ("glm5_2", ATTENTION_0),
    "hadamard": ("glm5_2", "mb1/layers.0.self_attention"),
    "shared_own_topk": ("glm5_2", "mb0/layers.3.self_attention"),
    "topk_leak": ("glm5_2", "mb0/layers.3.self_attention"),
    "norm_upcast": ("glm5_2", None),  # one extra bf16 rounding: within bf16's error (exact mode's, below)
    "router_ignores_bias": ("glm5_2", MOE),
    "router_activation_dtype": ("glm5_2", "mb0/layers.7.mlp"),  # bf16 only; layer 3 stays within its tolerance
    "router_unscaled": ("glm5_2", MOE),
    "mla_norm_eps": ("glm5_2", ATTENTION_0),
    "rmsnorm_low_precision": ("glm5_2", "mb1/layers.0.self_attention"),  # bf16 only; mb0 within its tolerance
    "mla_rope_half_split": ("glm5_2", ATTENTION_0),
    "indexer_rope_half_split": ("glm5_2", ATTENTION_0),
    "rope_theta_default": ("glm5_2", ATTENTION_0),
    "softmax_scale_nope": ("glm5_2", ATTENTION_0),
    "attention_mask_diagonal": ("glm5_2", ATTENTION_0),
    "indexer_mask_ahead": ("glm5_2", ATTENTION_0),
    "attention_softmax_bf16": ("glm5_2", ATTENTION_0),
    "moe_combine_bf16": ("glm5_2", MOE),
    "qkv_bias_dropped": ("dense", ATTENTION_0),
    "gqa_tiled": ("dense", ATTENTION_0),
}
# bf16-only faults compute exactly the clean model in fp32: the default tier feeds their bf16 run the clean fp32
# run (the same tensors, one job fewer); the slow tier runs the fault's own fp32 run, as the nightly does
BF16_ONLY = ("router_activation_dtype", "rmsnorm_low_precision")
# the indexer's Hadamard rotation refuses fp32 input (the job fails): its bf16 run is fed the clean fp32 run always
NO_FP32_RUN = ("hadamard",)
# the default tier: an attention fault, a MoE router fault, a bf16-only fault, a dense model's fault
DEFAULT_TIER = ("mla_norm_eps", "router_ignores_bias", "router_activation_dtype", "qkv_bias_dropped")


def replayed(parity_runs, dtype: str, source: Path, inject: str = "none", models=CPU_MODELS) -> dict:
    """The session's run of ``dtype`` with every block fed ``source``'s inputs (``--replay-from``)."""
    return parity_runs.get(dtype, inject, models, ("--replay-from", str(source)))


@pytest.fixture(scope="module")
def reference():
    return cmp.load(DEFAULT_REFERENCE, cmp.REFERENCE_KIND)


def nightly(parity_runs, reference, fault: str, full: bool) -> dict[str, cmp.Comparison]:
    """The fault judged in the nightly's modes, in order. ``full``: both modes, the bf16 run fed the fault's own fp32
    run, as the nightly runs them; otherwise the bf16 mode only where the fp32 mode passes (one job run a fault)."""
    model, _ = FAULTS[fault]
    models = (model,)
    own = fault not in NO_FP32_RUN and (full or fault not in BF16_ONLY)
    fp32_key = (fault, models) if own else ("none", CPU_MODELS)
    fp32 = replayed(parity_runs, "fp32", DEFAULT_REFERENCE, *fp32_key)
    judged = {"fp32-vs-cuda": cmp.compare(fp32, cmp.reference_run(reference, "fp32"), reference, models=models)}
    if full or not judged["fp32-vs-cuda"].failed:
        fp32_path = parity_runs.path("fp32", *fp32_key, ("--replay-from", str(DEFAULT_REFERENCE)))
        bf16 = replayed(parity_runs, "bf16", fp32_path, fault, models)
        judged["bf16-vs-own-fp32"] = cmp.compare(bf16, cmp.reference_run(reference, "bf16"), reference, models=models,
                                                 precise=fp32)  # fmt: skip
    return judged


def assert_named_at_its_module(fault: str, judged: dict[str, cmp.Comparison]) -> None:
    model, module = FAULTS[fault]
    failing = [mode for mode, result in judged.items() if result.failed]
    if module is None:
        assert not failing, (fault, {m: r.first_fault for m, r in judged.items()})
        return
    assert failing, f"{fault}: neither of the nightly's modes fails"
    first = judged[failing[0]]
    assert first.first_fault[model] == module, (fault, failing[0], first.first_fault)
    label = "replay" if failing[0] == "fp32-vs-cuda" else "bf16-vs-own-fp32"
    failed = {c.check for c in first.checks if c.status == "fail"}
    assert f"{model}.{label}.{module}" in failed, sorted(failed)  # through its own block tolerance
    for result in judged.values():  # the end to end values are a summary, never the verdict's reason
        assert all(c.check.split(".")[1] in ("replay", "bf16-vs-own-fp32") for c in result.checks
                   if c.status == "fail"), [c.check for c in result.checks if c.status == "fail"]  # fmt: skip


def test_every_injected_fault_is_judged_here():
    assert set(FAULTS) == set(parity_injections.UPSTREAM) | set(parity_injections.PORTING)
    assert len(parity_injections.PORTING) >= 8 and set(DEFAULT_TIER) <= set(FAULTS)
    assert set(BF16_ONLY) & set(DEFAULT_TIER) and set(BF16_ONLY) <= set(FAULTS)


def test_an_unknown_fault_is_refused_by_name():
    with pytest.raises(ValueError, match="inject 'no_such_fault': choose one of none, k_norm_eps"):
        parity_injections.inject("no_such_fault")


@pytest.mark.parametrize("fault", DEFAULT_TIER)
def test_a_fault_fails_the_nightly_and_is_named_at_its_module(fault, parity_runs, reference):
    assert_named_at_its_module(fault, nightly(parity_runs, reference, fault, full=False))


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_every_fault_fails_the_nightly_and_is_named_at_its_module(fault, parity_runs, reference):
    assert_named_at_its_module(fault, nightly(parity_runs, reference, fault, full=True))
