"""GLM-5.2 with IndexShare active: verl's engine against transformers' GlmMoeDsa, on the CPU harness.

The tiny GLM-5.2 (tests_npu/support/glm5_2_checkpoint.py: full layers 0, 1, 2, 6; shared 3, 4, 5, 7;
published layout, so shared layers ship no indexer) is built with ``index_topk`` 6 on 32-token
sequences: every query past the sixth keeps 6 of its keys, so what each layer selects decides the
output.

Both sides run in bf16, where a key whose indexer score is within rounding of the sixth-best can go
either way, and one such flip moves a token's log-prob by up to ~0.3 here. So the comparison is split:

* selection: shared layers reuse the latest full layer's top-k; each full layer's top-k differs from
  the float32 reference's (on the reference's own inputs) in no more queries than the bf16
  reference's does (rounding flips near-ties, and its drift grows with depth: the 7th layer's inputs
  differ by ~0.3 between the bf16 and float32 references);
* everything else: the reference, handed the engine's selections on its full layers (its shared
  layers take them over by themselves), gives the engine's log-probs to bf16 accuracy. Handed them on
  full layers while its shared layers select for themselves, or attending densely, it does not.
"""

from __future__ import annotations

import pytest
import torch
from support.glm5_2_checkpoint import INDEXER_TYPES, tiny_glm5_2_checkpoint
from test_glm5_bridge import cpu_engine, no_hadamard_shim_afterwards, select_npu_engine  # noqa: F401
from test_verl_engine_path import PROMPT, SEQ

pytestmark = pytest.mark.usefixtures("cpu_megatron_harness")

TOPK = 6
FULL_LAYERS = [i for i, kind in enumerate(INDEXER_TYPES) if kind == "full"]
SHARED_LAYERS = [i for i, kind in enumerate(INDEXER_TYPES) if kind == "shared"]
LOG_PROB_BOUND = 0.02  # same selections; the engine and the reference in bf16, or the reference in float32
ALL_KEYS = torch.arange(SEQ).expand(4, SEQ, SEQ)  # a "top-k" of every key: dense causal attention


@pytest.fixture(scope="module")
def glm5_2(tmp_path_factory):
    return tiny_glm5_2_checkpoint(tmp_path_factory.mktemp("glm5_2_topk6"), index_topk=TOPK)


@pytest.fixture(scope="module")
def engine(glm5_2):
    return cpu_engine(glm5_2[0])


@pytest.fixture(scope="module")
def hf_model(glm5_2):
    from transformers import GlmMoeDsaForCausalLM

    # eager: transformers' sdpa path turns the float DSA mask's -inf into +0 when it adds its boolean mask
    model = GlmMoeDsaForCausalLM.from_pretrained(glm5_2[0], dtype=torch.bfloat16, attn_implementation="eager")
    assert [layer.self_attn.skip_topk for layer in model.model.layers] == [k == "shared" for k in INDEXER_TYPES]
    return model.eval()


def engine_log_probs(engine, td):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(tu.get(engine.infer_batch(td)["model_output"], "log_probs"), td).float()


def hf_log_probs(model, input_ids, mask):
    with torch.no_grad():
        logits = model(input_ids, attention_mask=mask).logits[:, PROMPT - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, PROMPT:, None]).squeeze(-1)


def unpadded_batch(seed: int):
    """Four whole sequences in one micro-batch: the engine's and the reference's positions coincide."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    torch.manual_seed(seed)
    input_ids = torch.randint(0, 128, (4, SEQ))
    mask = torch.ones_like(input_ids)
    responses = input_ids[:, PROMPT:]
    fields = {
        "input_ids": input_ids, "prompts": input_ids[:, :PROMPT], "attention_mask": mask,
        "position_ids": torch.arange(SEQ).expand(4, SEQ).clone(), "responses": responses,
        "response_mask": mask[:, PROMPT:],
    }  # fmt: skip
    td = left_right_2_no_padding(DataProto.from_single_dict(fields, meta_info={"temperature": 1.0}).to_tensordict())
    tu.assign_non_tensor(td, global_batch_size=4, use_dynamic_bsz=False, micro_batch_size_per_gpu=4)
    tu.assign_non_tensor(td, calculate_entropy=False)
    return td, input_ids, mask


class OwnSelection(torch.nn.Module):
    """A shared layer's own indexer, made of the latest full layer's weights (a shared layer ships none);
    it calls ``forward`` directly so that the full layer's hooks do not see it."""

    def __init__(self, source: torch.nn.Module):
        super().__init__()
        self.source = [source]  # a list: not registered as a submodule

    def forward(self, *args, **kwargs):
        return self.source[0].forward(*args, **kwargs)


def reference_run(model, input_ids, mask, forced: dict[int, torch.Tensor], every_layer_selects=False):
    """The reference's log-probs; per full layer, its indexer's inputs and own top-k; per shared layer, the
    top-k it was handed.

    ``forced``: full layer -> the top-k its attention uses instead of its indexer's (which still runs and is
    recorded). ``every_layer_selects``: shared layers compute their own top-k, as if IndexShare were ignored.
    """
    inputs, natural, handed, hooks = {}, {}, {}, []

    def indexer_hook(number):
        def hook(module, args, kwargs, out):
            inputs[number], natural[number] = (args, kwargs), out
            return forced[number]

        return hook

    saved = [(layer.self_attn, layer.self_attn.indexer, layer.self_attn.skip_topk) for layer in model.model.layers]
    for number, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        if INDEXER_TYPES[number] == "full":
            hooks.append(attention.indexer.register_forward_hook(indexer_hook(number), with_kwargs=True))
            continue
        hooks.append(
            attention.register_forward_pre_hook(
                lambda m, a, kw, n=number: handed.update({n: kw["prev_topk_indices"]}), with_kwargs=True
            )
        )
        if every_layer_selects:
            source = max(f for f in FULL_LAYERS if f < number)
            attention.indexer = OwnSelection(model.model.layers[source].self_attn.indexer)
            attention.skip_topk = False
    try:
        log_probs = hf_log_probs(model, input_ids, mask)
    finally:
        for hook in hooks:
            hook.remove()
        for attention, indexer, skip in saved:
            attention.indexer, attention.skip_topk = indexer, skip
    return log_probs, inputs, natural, handed


def differing_queries(ours: torch.Tensor, theirs: torch.Tensor) -> int:
    """How many queries with a real choice (more causal keys than top-k) select different key sets."""
    return int((ours.sort(-1).values != theirs.sort(-1).values).any(-1)[:, TOPK:].sum())


@pytest.fixture(scope="module")
def engine_run(engine):
    """Whole sequences through the engine: (input_ids, mask, log-probs, layer -> (kind, top-k))."""
    from verl_npu.engine import index_share

    td, input_ids, mask = unpadded_batch(11)
    with index_share.record_topk() as trace:
        log_probs = engine_log_probs(engine, td)
    return input_ids, mask, log_probs, {number - 1: entry for number, entry in trace.items()}  # megatron counts from 1


@pytest.fixture(scope="module")
def references(glm5_2, hf_model, engine_run):
    """reference_run of the bf16 and the float32 reference, both handed the engine's selections."""
    from transformers import GlmMoeDsaForCausalLM

    input_ids, mask, _, trace = engine_run
    forced = {n: trace[n][1] for n in FULL_LAYERS}
    f32 = GlmMoeDsaForCausalLM.from_pretrained(glm5_2[0], dtype=torch.float32, attn_implementation="eager").eval()
    return {
        "bf16": reference_run(hf_model, input_ids, mask, forced),
        "fp32": reference_run(f32, input_ids, mask, forced),
        "fp32 model": f32,
    }


def test_shared_layers_use_the_latest_full_layers_top_k_on_both_sides(engine_run, references):
    _, _, _, trace = engine_run
    assert {n: kind for n, (kind, _) in sorted(trace.items())} == dict(enumerate(INDEXER_TYPES))
    _, _, _, handed = references["bf16"]
    for number in SHARED_LAYERS:
        source = max(f for f in FULL_LAYERS if f < number)
        assert torch.equal(trace[number][1], trace[source][1])
        assert torch.equal(handed[number], trace[source][1])


def test_full_layers_select_as_faithfully_as_the_bf16_reference(engine_run, references, record_property):
    """Against the float32 reference's indexer (on its own inputs), the engine's bf16 top-k differs in no more
    queries than the bf16 reference's does, give or take rounding luck; a wrong indexer (weights, RoPE layout,
    scale) differs in most queries."""
    _, _, _, trace = engine_run
    natural16, natural32 = references["bf16"][2], references["fp32"][2]
    report = {}
    for number in FULL_LAYERS:
        assert trace[number][1].shape == natural32[number].shape == (4, SEQ, TOPK)
        ours = differing_queries(trace[number][1], natural32[number])
        reference = differing_queries(natural16[number], natural32[number])
        report[number] = (ours, reference)
    queries = 4 * (SEQ - TOPK)
    record_property("topk_queries_differing_from_fp32_reference", report)  # in --junitxml; printed with -rP
    print(f"of {queries} queries per full layer, differing from the fp32 reference (engine, bf16 reference): {report}")
    assert all(ours <= max(2 * reference, 0.08 * queries) for ours, reference in report.values()), report
    assert sum(ours for ours, _ in report.values()) <= 1.5 * sum(ref for _, ref in report.values()) + 4, report


def test_given_the_engines_selections_the_reference_gives_the_engines_log_probs(engine_run, references):
    _, _, ours, _ = engine_run
    for precision in ("bf16", "fp32"):  # the bf16 reference itself is 0.012 from the fp32 one here
        theirs = references[precision][0]
        assert (ours - theirs).abs().max() < LOG_PROB_BOUND, precision


def test_the_bound_separates_index_share_from_its_alternatives(engine_run, references):
    """Shared layers selecting for themselves, or no selection at all, land far outside the bound."""
    input_ids, mask, ours, trace = engine_run
    f32 = references["fp32 model"]
    forced = {n: trace[n][1] for n in FULL_LAYERS}
    reselecting, *_ = reference_run(f32, input_ids, mask, forced, every_layer_selects=True)
    dense, *_ = reference_run(f32, input_ids, mask, dict.fromkeys(FULL_LAYERS, ALL_KEYS))
    for name, alternative in (("shared layers re-select", reselecting), ("dense", dense)):
        gap = (ours - alternative).abs().max().item()
        assert gap > 5 * LOG_PROB_BOUND, (name, gap)
