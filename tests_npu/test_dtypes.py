"""verl_npu.dtypes: the one table of dtype spellings the build plan and preflight's memory estimate share."""

from __future__ import annotations

import pytest

from verl_npu.dtypes import ALIASES, BYTES, DtypeError, nbytes, parse


@pytest.mark.parametrize(
    ("spelling", "canonical", "size"),
    [("fp32", "fp32", 4), ("float32", "fp32", 4), ("32", "fp32", 4), ("bf16", "bf16", 2), ("bfloat16", "bf16", 2),
     ("fp16", "fp16", 2), ("float16", "fp16", 2), ("16", "fp16", 2), ("fp8", "fp8", 1), ("int16", "int16", 2)],
)  # fmt: skip
def test_every_spelling_has_one_canonical_name_and_size(spelling, canonical, size):
    assert parse(spelling) == canonical and nbytes(spelling) == size


def test_none_is_the_default_and_an_unknown_spelling_is_a_named_error():
    assert parse(None, "bf16") == "bf16" and parse(None, "float32") == "fp32"
    with pytest.raises(DtypeError, match=r"optim.exp_avg_dtype='fp64': unknown dtype; known spellings: fp32"):
        parse("fp64", "fp32", "optim.exp_avg_dtype")
    with pytest.raises(DtypeError):
        parse(None)  # no default: nothing to fall back to
    assert issubclass(DtypeError, ValueError)


def test_the_build_plan_and_the_memory_model_read_the_same_table():
    from verl_npu.engine import build_plan
    from verl_npu.preflight import memory

    for allowed in build_plan.PRECISIONS.values():
        assert set(allowed) <= set(BYTES)
    assert set(ALIASES.values()) == set(BYTES)
    # precision-aware, bf16 params spelled bfloat16, fp32 main params spelled 32: int16 remainders
    precision = memory.Precision(
        params_dtype="bfloat16", use_precision_aware_optimizer=True, main_params_dtype="32", exp_avg_dtype="bf16"
    )
    assert precision.optimizer_bytes_per_param() == {
        "main_params": ("int16", 2),
        "exp_avg": ("bf16", 2),
        "exp_avg_sq": ("fp32", 4),
    }
