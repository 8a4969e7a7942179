"""The leak sentinel's arithmetic (CPU); its real use on device memory is in test_engine_accel.py."""

from __future__ import annotations

import pytest

from verl_npu.testing.leak_sentinel import measure_growth


def test_flat_memory_after_warmup_is_no_leak():
    values = iter([100, 300, 350] + [400] * 20)
    report = measure_growth(lambda i: None, 23, lambda: next(values))
    assert report.growth_per_micro_batch == 0.0 and not report.leaks


def test_linear_growth_is_reported_per_micro_batch():
    held: list[bytes] = []

    def micro_batch(i: int) -> None:
        held.append(b"x" * 1024)  # stands in for one retained autograd graph per micro-batch

    report = measure_growth(micro_batch, 20, lambda: sum(len(b) for b in held))
    assert report.growth_per_micro_batch == pytest.approx(1024.0) and report.leaks


def test_too_few_micro_batches_is_an_error():
    with pytest.raises(ValueError, match="need more than warmup"):
        measure_growth(lambda i: None, 3, lambda: 0)
