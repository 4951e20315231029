"""The global batch of each step: Megatron's batch-size ramp-up (`--rampup-batch-size START INCREMENT SAMPLES`,
`train.rampup_batch_size`).

The micro-batch size stays fixed; a step's number of micro-batches follows the samples consumed
before it. The batch starts at `start` samples and grows by `increment` each time the consumed
samples pass one of the evenly spaced points `k * samples / increments` (increments = (final -
start) / increment), so from `samples` consumed samples on it is `train.global_batch_size`. Without a
ramp every step takes the final batch. Everything here is a function of the consumed samples, which
checkpoints hold, so a resumed run continues the ramp where it was, also under a changed ramp.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_train.config import TrainConfig


@dataclass(frozen=True)
class BatchRamp:
    """Global batch sizes by consumed samples: `start` growing by `increment` to `final` over `samples`
    samples (`samples` 0: always `final`)."""

    final: int
    start: int
    increment: int
    samples: int

    @property
    def increments(self) -> int:
        return (self.final - self.start) // self.increment if self.samples else 0

    def batch_size(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after `consumed_samples` samples."""
        if consumed_samples >= self.samples:
            return self.final
        return self.start + consumed_samples * self.increments // self.samples * self.increment

    def sizes(self) -> list[int]:
        """Every global batch a step of the ramp takes, smallest first (the final batch last)."""
        return [self.start + k * self.increment for k in range(self.increments)] + [self.final]

    def walk(self, consumed_samples: int, end: int) -> tuple[int, int]:
        """(steps, consumed samples after them) of training from `consumed_samples` while a whole step fits
        within `end` samples (Megatron drops a partial last batch the same way)."""
        steps = 0
        while consumed_samples < self.samples:
            size = self.batch_size(consumed_samples)
            if consumed_samples + size > end:
                return steps, consumed_samples
            consumed_samples += size
            steps += 1
        whole = max(0, (end - consumed_samples) // self.final)
        return steps + whole, consumed_samples + whole * self.final

    def describe(self) -> str:
        """The ramp in words, for logs and the planner ('' without a ramp)."""
        if not self.samples:
            return ""
        return (f"the global batch ramps from {self.start} by {self.increment} to {self.final} over "
                f"{self.samples:,} samples (train.rampup_batch_size)")


def batch_ramp(train: TrainConfig) -> BatchRamp:
    """`train.rampup_batch_size` ([start, increment, samples], validated by moe_train.config) as a BatchRamp."""
    if train.rampup_batch_size is None:
        return BatchRamp(train.global_batch_size, train.global_batch_size, train.global_batch_size, 0)
    start, increment, samples = train.rampup_batch_size
    return BatchRamp(train.global_batch_size, start, increment, samples)
