"""Memory-leak sentinel: run N micro-batches and report device-memory growth per micro-batch.

A training step that keeps model outputs across micro-batches without detaching them pins one
autograd graph per micro-batch (verl issues #6696, #7874): memory grows linearly until OOM. The
sentinel fits a line through the memory readings after a warm-up and reports its slope.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class LeakReport:
    readings: tuple[int, ...]
    growth_per_micro_batch: float  # bytes, least-squares slope after the warm-up

    @property
    def leaks(self) -> bool:
        return self.growth_per_micro_batch > 0.5  # below one byte per micro-batch is rounding


def _slope(values: list[int]) -> float:
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


def measure_growth(
    micro_batch: Callable[[int], None], n: int, memory: Callable[[], int], *, warmup: int = 3
) -> LeakReport:
    """Run ``micro_batch(i)`` ``n`` times; ``memory()`` is read after each (e.g. memory_allocated)."""
    if n <= warmup + 1:
        raise ValueError(f"need more than warmup+1 = {warmup + 1} micro-batches, got {n}")
    readings = []
    for i in range(n):
        micro_batch(i)
        readings.append(int(memory()))
    return LeakReport(tuple(readings), _slope(readings[warmup:]))
