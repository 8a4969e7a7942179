"""Let megatron-core's DSA attention build on the local (non-TransformerEngine) spec.

Changes: adds ``LocalSpecProvider.linear()`` returning ``DuplicatedLinear``, and, only where
TransformerEngine is absent, sets ``multi_latent_attention.Linear`` (``None`` without TE) to the same
class so MLA accepts it for its q/kv down projections.
Why: ``get_dsa_module_spec_for_backend`` calls ``backend.linear()`` for the indexer projections
(built with ``parallel_mode="duplicated"``) and the MLA down projections; only TE's provider has
``linear()``, so DSA cannot be built with the local provider on Ascend, on CUDA without TE or on CPU.
Upstream: megatron-core 0.18.0 models/backends.py (LocalSpecProvider),
models/gpt/experimental_attention_variant_module_specs.py (get_dsa_module_spec_for_backend),
transformer/multi_latent_attention.py (MLASelfAttention.__init__).
Remove when: LocalSpecProvider provides linear() and MLA accepts it without TransformerEngine.
"""

from __future__ import annotations

import sys

import torch

from verl_npu.patching import Patch

MLA_MODULE = "megatron.core.transformer.multi_latent_attention"


class DuplicatedLinear(torch.nn.Module):
    """y = x W^T (+ b) with the full weight on every tensor-parallel rank.

    Accepts the constructor arguments MLA and the DSA indexer pass to ``backend.linear()``, and
    returns ``(output, bias)`` like megatron's parallel linears. With sequence parallelism the
    input is sequence-sharded, so each rank's weight gradient is partial: the parameters carry
    ``sequence_parallel=True`` and megatron all-reduces them over the tensor-parallel group.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        bias: bool = True,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        parallel_mode: str | None = "duplicated",
        gather_output: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group=None,
        name: str | None = None,
    ):
        super().__init__()
        if parallel_mode not in (None, "duplicated"):
            raise ValueError(f"DuplicatedLinear only supports parallel_mode='duplicated', got {parallel_mode!r}")
        if skip_weight_param_allocation:
            raise ValueError("DuplicatedLinear always allocates its weight (skip_weight_param_allocation=True given)")
        self.config = config
        self.skip_bias_add = skip_bias_add and bias
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, device=device, dtype=config.params_dtype))
        self.bias = (
            torch.nn.Parameter(torch.zeros(output_size, device=device, dtype=config.params_dtype)) if bias else None
        )
        if config.perform_initialization:
            init_method(self.weight)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel
            param.allreduce = not (is_expert and config.expert_model_parallel_size > 1)

    def forward(self, x: torch.Tensor):
        if self.skip_bias_add:
            return torch.nn.functional.linear(x, self.weight), self.bias
        return torch.nn.functional.linear(x, self.weight, self.bias), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {}, sharded_offsets)


def _build_linear(_original):
    def linear(self) -> type:
        """Which linear module the local backend uses for duplicated (non-parallel) projections."""
        return DuplicatedLinear

    return linear


def _build_mla_linear(_original):
    return DuplicatedLinear


def _te_present() -> str | None:
    if getattr(sys.modules[MLA_MODULE], "Linear", None) is not None:
        return "TransformerEngine is installed; MLA keeps its own Linear"
    return None


LOCAL_LINEAR = Patch(
    id="dsa-local-spec-linear",
    target="megatron.core.models.backends:LocalSpecProvider.linear",
    kind="add",
    platforms=frozenset({"ascend", "cuda", "cpu"}),
    requires={"megatron-core": "==0.18.0"},
    source_sha256="344b285815be40409b6685789bf8168d7427aeae3bb7abacfc268764f36c7786",
    reason="the DSA spec calls backend.linear(), which the local spec provider lacks",
    upstream="megatron-core 0.18.0 models/backends.py::LocalSpecProvider",
    remove_when="LocalSpecProvider defines linear()",
    build=_build_linear,
)

MLA_LINEAR = Patch(
    id="mla-accepts-duplicated-linear",
    target=f"{MLA_MODULE}:Linear",
    kind="replace",
    platforms=frozenset({"ascend", "cuda", "cpu"}),
    requires={"megatron-core": "==0.18.0"},
    source_sha256="0ea59ca2dfa2f1a960fdc3724f16e51c7cb659a4b285bb2d45d7f6544f90ab93",
    reason="without TransformerEngine MLA's Linear is None and MLA rejects the local linear() for its down projections",
    upstream="megatron-core 0.18.0 transformer/multi_latent_attention.py::MLASelfAttention.__init__",
    remove_when="MLA accepts a local duplicated linear without TransformerEngine",
    build=_build_mla_linear,
    condition=_te_present,
    fingerprint_of="MLASelfAttention.__init__",
)

PATCHES = (LOCAL_LINEAR, MLA_LINEAR)
