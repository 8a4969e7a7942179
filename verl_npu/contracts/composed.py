"""Facts that hold only when upstream pieces compose, checked by running them where they are installed.

A contract pins one upstream symbol; some faults live between symbols. MindSpeed core_r0.18.0's DSA feature wraps
``TransformerConfig.__post_init__`` for kv-allgather CP and its own patch manager re-applies another patch of the same
attribute in the same ``repatch``: every symbol reads as recorded, and the wrapper is gone
(verl_npu/runtime_patches/mindspeed_dsa_cp_config.py puts it back). :func:`run_checks` executes the engine's real
steps over the installed MindSpeed and says whether the composed result holds. ``verl-npu contracts verify`` runs it
in a fresh process (``python -m verl_npu.contracts.composed``) wherever MindSpeed is installed, so an image build
fails on it; the ascend_sim tier runs it over MindSpeed's pinned source on the CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback

CP_CONFIG = "mindspeed-dsa-cp-config-survives-repatch"
# The GLM-5.2 example's attention at its train parallel sizes (examples/glm5_2/run_glm5_2_grpo_a3.sh): MLA with a
# 512 latent and 64 rope channels, 64 heads, DSA with MindSpeed's four switches, CP 4 over kv-allgather, TP 2.
ENGINE = {
    "vanilla_mbridge": True,
    "tensor_model_parallel_size": 2,
    "context_parallel_size": 4,
    "override_transformer_config": {
        "use_dsa_absorb": True,
        "use_fused_lightning_indexer": True,
        "use_fused_sparse_flash_attention": True,
        "use_fused_lightning_indexer_kl_loss": True,
        "context_parallel_algo": "kvallgather_cp_algo",
    },
}
MLA_FIELDS = {
    "num_layers": 2, "hidden_size": 6144, "num_attention_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
    "qk_head_dim": 192, "qk_pos_emb_head_dim": 64, "v_head_dim": 256, "normalization": "RMSNorm",
}  # fmt: skip
DSA_INDEXER = {"index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128, "num_attention_heads": 64,
               "kv_lora_rank": 512, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-5}  # fmt: skip
ENGINES = 2  # the actor and a second engine in the same process (the reference model) each run repatch


@dataclasses.dataclass(frozen=True)
class ComposedResult:
    id: str
    ok: bool
    detail: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_cp_config_survives_repatch() -> ComposedResult:
    """The engine's MindSpeed step for a DSA model at CP 4, twice, then the MLA config megatron builds for it."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from verl_npu.engine import build
    from verl_npu.engine.build_plan import build_plan

    plan = build_plan(ENGINE, {}, DSA_INDEXER, "ascend")
    try:
        for _ in range(ENGINES):
            build.enter_mindspeed(plan)
        config = MLATransformerConfig(
            **MLA_FIELDS, tensor_model_parallel_size=2, context_parallel_size=4, **plan.transformer_overrides
        )
    except Exception as exc:  # what MindSpeed and megatron raise is the finding
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return ComposedResult(
            CP_CONFIG, False, f"after repatch a DSA config at CP 4 fails: {type(exc).__name__}: {exc} "
            f"({where.filename}:{where.lineno})",
        )  # fmt: skip
    if config.context_parallel_size != 4:
        return ComposedResult(CP_CONFIG, False, f"the config built with CP {config.context_parallel_size}, not 4")
    return ComposedResult(CP_CONFIG, True, f"repatch x{ENGINES}, then MLATransformerConfig(CP 4, DSA) builds")


def run_checks() -> list[ComposedResult]:
    """Every composed check, in this process (MindSpeed importable, verl-npu's runtime layer loaded)."""
    return [check_cp_config_survives_repatch()]


def main() -> int:
    """Load verl-npu's layer as on an Ascend node (MindSpeed and the runtime patches), run the checks, print JSON."""
    os.environ.setdefault("VERL_NPU_PLATFORM", "ascend")  # an image build has no NPU; the layer is what matters
    import verl_npu.megatron_adaptor  # noqa: F401  (MegatronAdaptor -> TE-NPU -> MindSpeed, then our patches)

    results = run_checks()
    json.dump([r.to_dict() for r in results], sys.stdout)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
