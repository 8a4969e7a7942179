"""An independent reference for the parity models: transformers' own implementation in float64.

The CUDA reference (ci/baselines/parity/reference.json) runs verl-npu's engine, so a bug in code both share (the
GLM-5 bridge, IndexShare, the config mapping) shows on neither side. This module computes the parity evaluation
with code that shares none of it: transformers' ``GlmMoeDsaForCausalLM`` for ``glm5_2`` and ``Qwen2ForCausalLM``
for ``dense``, loaded from the parity checkpoint (verl_npu.parity.models.write_checkpoint), with

* every hard-coded float32 cast in the modeling code those models run widened to float64 (:data:`WIDENED_CASTS`),
  for the duration of the computation only and without touching installed files; a transformers whose source no
  longer has the casts pinned here is refused with the counts expected and found;
* the MLA latent norms (``q_a_layernorm``, ``kv_a_layernorm``) given the config's ``rms_norm_eps``, as vLLM's
  rollout builds them (docs/parity.md, "The MLA latent norms' epsilon"); transformers builds them with its 1e-6;
* eager attention (transformers' other paths do not apply GLM-5's float DSA mask as such);
* the checkpoint's interleaved RoPE rows (``rope_interleave`` / ``indexer_rope_interleave`` true, as published)
  reordered to the half-split pairs that transformers' GlmMoeDsa computes whatever the config says.

:func:`evaluate` returns what a parity run's ``eval`` holds: per-token log-probs of the evaluation batch, split in
micro-batches as verl_npu/parity/job.py splits it, and each DSA layer's top-k per query row, under the run's keys
(``mb{i}/layers.{n}``, rows ``(sequence in the micro-batch, query)``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verl_npu.errors import UserError
from verl_npu.parity.models import MODELS, ParityModel, evaluation_tokens, write_checkpoint

TRANSFORMERS_CLASSES = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class IndependentReferenceError(UserError):
    """transformers' modeling code is not the one this reference was written against, or a model is unknown."""


@dataclasses.dataclass(frozen=True)
class Widened:
    """One function of a transformers modeling module whose float32 casts are widened: where, and how many."""

    module: str  # e.g. "transformers.models.qwen2.modeling_qwen2"
    qualname: str  # "eager_attention_forward" or "Class.method"
    casts: int  # the float32 casts in its code (comments not counted)
    part: str  # what it computes: "norm", "indexer", "attention", "router" or "rotary"


# What each model family runs in float32 whatever its dtype, read from transformers 5.10.4 (the stack's): RMSNorm's
# variance, the eager softmax, the router's logits, the indexer's weights and scores, the rotary frequencies.
_GLM = "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa"
_QWEN2 = "transformers.models.qwen2.modeling_qwen2"
WIDENED_CASTS: dict[str, tuple[Widened, ...]] = {
    "glm_moe_dsa": (
        Widened(_GLM, "GlmMoeDsaRMSNorm.forward", 1, "norm"),
        Widened(_GLM, "GlmMoeDsaIndexer.forward", 3, "indexer"),
        Widened(_GLM, "eager_attention_forward", 1, "attention"),
        Widened(_GLM, "GlmMoeDsaTopkRouter.forward", 2, "router"),
        Widened(_GLM, "GlmMoeDsaRotaryEmbedding.compute_default_rope_parameters", 1, "rotary"),
        Widened(_GLM, "GlmMoeDsaRotaryEmbedding.forward", 4, "rotary"),
    ),
    "qwen2": (
        Widened(_QWEN2, "Qwen2RMSNorm.forward", 1, "norm"),
        Widened(_QWEN2, "eager_attention_forward", 1, "attention"),
        Widened(_QWEN2, "Qwen2RotaryEmbedding.compute_default_rope_parameters", 1, "rotary"),
        Widened(_QWEN2, "Qwen2RotaryEmbedding.forward", 4, "rotary"),
    ),
}
# float32 in those modules' code outside WIDENED_CASTS, and why it stays: the router's score-correction bias buffer
# is replaced by the checkpoint's float32 values, which float64 holds exactly (the model is cast to float64 after
# loading)
KEPT_CASTS: dict[str, dict[str, int]] = {
    "glm_moe_dsa": {"GlmMoeDsaTopkRouter.__init__": 1},
    "qwen2": {},
}

# torch.float32 / torch.float (not torch.float16 or float64) and Tensor.float()
_DTYPE = re.compile(r"\btorch\.float(?:32)?\b(?!\d)")
_METHOD = re.compile(r"\.float\(\)")


def _code_only(source: str) -> str:
    """``source`` with its comments blanked (a cast quoted in a comment is not a cast)."""
    lines = source.splitlines(keepends=True)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            line = lines[row - 1]
            lines[row - 1] = line[:col] + " " * (len(line.rstrip("\n")) - col) + line[len(line.rstrip("\n")) :]
    return "".join(lines)


def _count_casts(code: str) -> int:
    return len(_DTYPE.findall(code)) + len(_METHOD.findall(code))


def _widen(code: str) -> str:
    return _METHOD.sub(".double()", _DTYPE.sub("torch.float64", code))


def _resolve(module: Any, qualname: str) -> tuple[Any, str, Any]:
    owner_name, _, name = qualname.rpartition(".")
    owner = getattr(module, owner_name) if owner_name else module
    return owner, name, inspect.getattr_static(owner, name)


def _function_sources(module: Any) -> dict[str, str]:
    """Qualified name -> comment-free source of every function and method defined in ``module``."""
    out = {}
    for name, value in vars(module).items():
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            out[name] = _code_only(textwrap.dedent(inspect.getsource(value)))
        elif inspect.isclass(value) and value.__module__ == module.__name__:
            for attr, member in vars(value).items():
                function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                if inspect.isfunction(function):
                    out[f"{name}.{attr}"] = _code_only(textwrap.dedent(inspect.getsource(function)))
    return out


def check_casts(model_type: str) -> None:
    """Every float32 cast in the family's modeling module is widened or kept on purpose, in the numbers pinned."""
    import importlib

    widened = WIDENED_CASTS[model_type]
    expected = {w.qualname: w.casts for w in widened} | KEPT_CASTS[model_type]
    module = importlib.import_module(widened[0].module)
    found = {name: n for name, code in _function_sources(module).items() if (n := _count_casts(code))}
    if found != expected:
        differ = sorted(
            f"{name}: expected {expected.get(name, 0)}, found {found.get(name, 0)}"
            for name in expected.keys() | found.keys()
            if expected.get(name, 0) != found.get(name, 0)
        )
        raise IndependentReferenceError(
            f"{module.__name__} (transformers {_transformers_version()}): float32 casts per function differ from "
            f"verl_npu/parity/independent.py's WIDENED_CASTS/KEPT_CASTS: {'; '.join(differ)}. Read the new "
            "source and update those tables (widen each cast the float64 reference must not run in float32)"
        )


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


# What megatron-core computes in float32 whatever the run's dtype, so that even the engine's fp64 run has it in float32:
# the rotary angles (megatron/core/models/common/embeddings/rotary_pos_embedding.py builds inv_freq and the
# position-frequency products in float32) and the router's logits (GLM-5.2's moe_router_dtype, float32)
ENGINE_FLOAT32 = frozenset({"rotary", "router"})
PARTS = frozenset({"norm", "indexer", "attention", "router", "rotary"})


@contextlib.contextmanager
def widened_casts(model_type: str, float32: frozenset[str] = frozenset()) -> Iterator[None]:
    """transformers' float32 casts of ``model_type``'s modeling code widened to float64 inside the block only, but
    for the parts named in ``float32``."""
    import importlib

    if model_type not in WIDENED_CASTS:
        raise IndependentReferenceError(f"model_type={model_type!r}: expected one of {sorted(WIDENED_CASTS)}")
    if unknown := set(float32) - PARTS:
        raise IndependentReferenceError(f"float32={sorted(unknown)}: expected parts among {sorted(PARTS)}")
    check_casts(model_type)
    restore = []
    try:
        for widened in WIDENED_CASTS[model_type]:
            if widened.part in float32:
                continue
            module = importlib.import_module(widened.module)
            owner, name, original = _resolve(module, widened.qualname)
            function = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original
            code = _widen(_code_only(textwrap.dedent(inspect.getsource(function))))
            namespace: dict[str, Any] = {}
            # compiled in the module's own globals, so that the widened function sees what the original sees
            exec(compile(code, f"<widened {widened.module}.{widened.qualname}>", "exec"), vars(module), namespace)
            replacement = namespace[name]
            if _count_casts(code) or not isinstance(replacement, type(original)):
                raise IndependentReferenceError(f"{widened.qualname}: widening left a float32 cast or changed its kind")
            restore.append((owner, name, original))
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, original in reversed(restore):
            setattr(owner, name, original)


# --- the checkpoint as transformers reads it -------------------------------------------------------------------------
def _half_split(rope_dim: int) -> Any:
    """For each half-split rotary position (pairs (i, i + d/2)), the interleaved one (pairs (2i, 2i+1)) it holds."""
    import torch

    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def _reordered(tensor: Any, block: int, start: int, order: Any) -> Any:
    """``tensor`` with rows ``start .. start+len(order)`` of each block of ``block`` rows taken in ``order``."""
    rows = tensor.reshape(-1, block, *tensor.shape[1:]).clone()
    rows[:, start : start + len(order)] = rows[:, start + order]
    return rows.reshape(tensor.shape)


def transformers_checkpoint(model: ParityModel, path: Path) -> Path:
    """The parity checkpoint, its rotary rows in the layout transformers computes with, in ``path``."""
    from safetensors.torch import load_file, save_file

    write_checkpoint(model, path)
    config = model.config
    if config["model_type"] != "glm_moe_dsa":
        return path
    rope = config["qk_rope_head_dim"]
    order = _half_split(rope)
    index_order = order if config.get("indexer_rope_interleave", True) else None
    main_order = order if config.get("rope_interleave", True) else None
    tensors = load_file(path / "model.safetensors")
    for name, tensor in tensors.items():
        if main_order is not None and name.endswith("self_attn.q_b_proj.weight"):
            tensors[name] = _reordered(tensor, config["qk_head_dim"], config["qk_nope_head_dim"], main_order)
        elif main_order is not None and name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            tensors[name] = _reordered(tensor, tensor.shape[0], config["kv_lora_rank"], main_order)
        elif index_order is not None and name.endswith("indexer.wq_b.weight"):
            tensors[name] = _reordered(tensor, config["index_head_dim"], 0, index_order)
        elif index_order is not None and name.endswith(
            ("indexer.wk.weight", "indexer.k_norm.weight", "indexer.k_norm.bias")
        ):
            tensors[name] = _reordered(tensor, tensor.shape[0], 0, index_order)
    save_file(tensors, str(path / "model.safetensors"), {"format": "pt"})
    return path


# --- the evaluation --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Evaluation:
    logprobs: list[list[float]]  # per sequence of the evaluation batch: log p(token t | < t), t >= 1
    topk: dict[str, dict[tuple[int, int], frozenset[int]]]  # "mb{i}/layers.{n}" -> (sequence, query) -> keys
    latent_norm_eps: dict[str, float]  # what transformers built the MLA latent norms with, and what ran


def _load(model: ParityModel, checkpoint: Path, latent_norm_eps: float | None) -> tuple[Any, dict[str, float]]:
    import torch
    import transformers

    model_type = model.config["model_type"]
    cls = getattr(transformers, TRANSFORMERS_CLASSES[model_type])
    # eager experts: the grouped-matmul path takes no float64
    moe = {"experts_implementation": "eager"} if model_type == "glm_moe_dsa" else {}
    hf = cls.from_pretrained(checkpoint, dtype=torch.float64, attn_implementation="eager", **moe)
    hf = hf.to(torch.float64).eval()
    narrow = sorted(n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_floating_point()
                    and t.dtype != torch.float64)  # fmt: skip
    if narrow:
        raise IndependentReferenceError(f"{cls.__name__} in float64 still holds {narrow[:5]} in another dtype")
    eps: dict[str, float] = {}
    if model_type == "glm_moe_dsa":
        norms = [
            n for layer in hf.model.layers for n in (layer.self_attn.q_a_layernorm, layer.self_attn.kv_a_layernorm)
        ]
        eps["transformers"] = norms[0].variance_epsilon
        eps["used"] = hf.config.rms_norm_eps if latent_norm_eps is None else latent_norm_eps
        for norm in norms:
            norm.variance_epsilon = eps["used"]
    return hf, eps


def evaluate(
    name: str, workdir: str | Path, latent_norm_eps: float | None = None, float32: frozenset[str] = frozenset()
) -> Evaluation:
    """transformers' float64 evaluation of parity model ``name``; ``latent_norm_eps`` overrides the MLA latent norms'
    eps (None: the config's rms_norm_eps, the rollout's choice); ``float32`` names the parts left in float32
    (:data:`ENGINE_FLOAT32`: those the engine computes in float32 even in its fp64 run)."""
    import torch

    if name not in MODELS or MODELS[name].config["model_type"] not in TRANSFORMERS_CLASSES:
        choices = sorted(n for n, m in MODELS.items() if m.config["model_type"] in TRANSFORMERS_CLASSES)
        raise IndependentReferenceError(f"parity model {name!r}: the independent reference has {choices}")
    model = MODELS[name]
    model_type = model.config["model_type"]
    checkpoint = transformers_checkpoint(model, Path(workdir) / f"{name}-transformers")
    tokens = torch.from_numpy(evaluation_tokens(model))
    logprobs: list[list[float]] = []
    topk: dict[str, dict[tuple[int, int], frozenset[int]]] = {}
    with widened_casts(model_type, frozenset(float32)), torch.no_grad():
        hf, eps = _load(model, checkpoint, latent_norm_eps)
        selections: dict[int, Any] = {}
        handles = []
        for n, layer in enumerate(getattr(hf.model, "layers", [])):
            attention = layer.self_attn
            if hasattr(attention, "indexer"):
                handles.append(attention.register_forward_hook(_record_selection(selections, n), with_kwargs=True))
                handles.append(attention.indexer.register_forward_hook(_record_indexer(selections, n)))
        try:
            for index, micro in enumerate(tokens.chunk(model.micro_batches, dim=0)):
                selections.clear()
                logits = hf(micro).logits
                wide = torch.log_softmax(logits[:, :-1].double(), dim=-1)
                logprobs += wide.gather(-1, micro[:, 1:, None]).squeeze(-1).tolist()
                for n, indices in sorted(selections.items()):
                    topk[f"mb{index}/layers.{n}"] = _rows(indices)
        finally:
            for handle in handles:
                handle.remove()
    return Evaluation(logprobs, topk, eps)


def _record_indexer(selections: dict[int, Any], layer: int):
    def hook(_module, _args, output):
        selections[layer] = output

    return hook


def _record_selection(selections: dict[int, Any], layer: int):
    """The top-k the layer's attention ran with: its own indexer's, or the previous layer's on a shared layer."""

    def hook(module, _args, kwargs, _output):
        previous = kwargs.get("prev_topk_indices")
        if module.skip_topk and previous is not None:
            selections[layer] = previous
        elif layer not in selections:
            raise IndependentReferenceError(f"layers.{layer}: its attention ran with no top-k from its indexer")

    return hook


def _rows(indices: Any) -> dict[tuple[int, int], frozenset[int]]:
    """(sequence, query) -> the causal keys selected (a query before the k-th selects masked keys too)."""
    out = {}
    for i, row in enumerate(indices.tolist()):
        for j, keys in enumerate(row):
            out[(i, j)] = frozenset(k for k in keys if 0 <= k <= j)
    return out


# --- the judgement ---------------------------------------------------------------------------------------------------
def disagreements(run_eval: dict[str, Any], reference: Evaluation, logprob_bound: float) -> list[str]:
    """How a parity run's ``eval`` (verl_npu/parity/job.py) differs from the independent reference: log-probs
    further apart than ``logprob_bound``, and per DSA layer the stored query rows that select other keys."""
    import numpy as np

    from verl_npu.parity.probes import topk_sets

    ours, theirs = np.asarray(run_eval["logprobs"], dtype=float), np.asarray(reference.logprobs, dtype=float)
    if ours.shape != theirs.shape:
        return [f"log-probs: the run has shape {ours.shape}, the reference {theirs.shape}"]
    out = []
    gap = np.abs(ours - theirs)
    if not gap.max() <= logprob_bound:  # NaN fails too
        (sequence, token) = np.unravel_index(int(np.nanargmax(gap)), gap.shape)
        out.append(
            f"log-probs: max |run - reference| {gap.max():.3g} (sequence {sequence}, token {token + 1}), mean "
            f"{gap.mean():.3g}, allowed <= {logprob_bound:.3g}"
        )
    stored = run_eval.get("topk", {})
    if sorted(stored) != sorted(reference.topk):
        out.append(f"top-k layers: the run has {sorted(stored)}, the reference {sorted(reference.topk)}")
    for key in sorted(stored.keys() & reference.topk.keys(), key=_layer_order):
        rows = topk_sets(stored[key])
        other = [row for row, keys in rows.items() if reference.topk[key].get(row) != keys]
        if other:
            out.append(f"{key} ({stored[key]['kind']}): {len(other)} of {len(rows)} query rows select other keys, "
                       f"first (sequence, query) {other[0]}")  # fmt: skip
    return out


def _layer_order(key: str) -> tuple[int, int]:
    micro_batch, _, layer = key.partition("/layers.")
    return int(layer), int(micro_batch.removeprefix("mb"))


# How far the engine's fp64 log-probs may be from the reference with the engine's float32 parts (ENGINE_FLOAT32): 1000x
# the difference measured on the CPU (1.2e-14 glm5_2, 1.5e-13 dense; tests_npu/parity/test_parity_independent.py),
# float64 rounding with room for another BLAS or summation order
ENGINE_PRECISION_BOUND = {"glm5_2": 1e-11, "dense": 1e-10}


def check_run(run: dict[str, Any], workdir: str | Path) -> dict[str, list[str]]:
    """Each model of an fp64 parity run against the independent reference: model -> its disagreements (none: it
    agrees). Only fp64 runs: in fp32 or bf16 the engine's own rounding, not a shared bug, would decide."""
    if run.get("dtype") != "fp64":
        raise IndependentReferenceError(
            f"dtype={run.get('dtype')!r}: the independent reference judges fp64 runs (`verl-npu parity run --dtype "
            "fp64`), whose only float32 parts it reproduces"
        )
    unknown = sorted(set(run["models"]) - set(ENGINE_PRECISION_BOUND))
    if unknown:
        raise IndependentReferenceError(
            f"models {unknown}: the independent reference has {sorted(ENGINE_PRECISION_BOUND)}"
        )
    return {
        name: disagreements(
            entry["eval"], evaluate(name, workdir, float32=ENGINE_FLOAT32), ENGINE_PRECISION_BOUND[name]
        )
        for name, entry in run["models"].items()
    }
