"""Train/valid split, global-batch slicing for data-parallel ranks, and the resumable position.

Global batch ``s`` is global samples ``[c, c + global_batch_size)`` where ``c`` is the number of
samples consumed before it (``s * global_batch_size`` with a constant batch size). It is split
Megatron-style: micro-step ``i`` takes ``micro_batch_size * dp_size`` consecutive samples and
data-parallel rank ``r`` takes the ``r``-th run of ``micro_batch_size`` of them. Every layout
therefore sees the same samples in each global batch; only their distribution over ranks and
micro-batches differs.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from moe_train.data.errors import DataError
from moe_train.data.indexed_dataset import IndexedDataset
from moe_train.data.packing import SampleStream, seeded_rng

_SPLIT_SALT = 0x5B117


def split_documents(
    dataset: IndexedDataset, valid_fraction: float, split_seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Sequence indices of the train and valid splits, disjoint, each sorted.

    Whole documents (Megatron's ``document_indices``) are assigned to one split at random. The
    split has its own seed so validation sets stay comparable across runs with different
    training seeds.
    """
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    bounds = np.asarray(dataset.document_indices, dtype=np.int64)
    n_docs = bounds.size - 1
    n_valid = 0
    if valid_fraction > 0:
        if n_docs < 2:
            raise DataError(f"{dataset.prefix}: cannot split {n_docs} document(s) into train and valid")
        n_valid = min(max(int(round(valid_fraction * n_docs)), 1), n_docs - 1)
    chosen = np.zeros(n_docs, dtype=bool)
    chosen[seeded_rng(split_seed, _SPLIT_SALT).permutation(n_docs)[:n_valid]] = True
    return _sequences_of(bounds, np.flatnonzero(~chosen)), _sequences_of(bounds, np.flatnonzero(chosen))


def _sequences_of(bounds: np.ndarray, docs: np.ndarray) -> np.ndarray:
    starts, counts = bounds[docs], bounds[docs + 1] - bounds[docs]
    total = int(counts.sum())
    run_starts = np.repeat(starts - (np.cumsum(counts) - counts), counts)
    return run_starts + np.arange(total, dtype=np.int64)


def microbatch_start(
    consumed_samples: int, micro_batch_size: int, dp_size: int, dp_rank: int, micro_index: int
) -> int:
    """First global sample of micro-batch ``micro_index`` on data-parallel rank ``dp_rank`` in the
    global batch that starts after ``consumed_samples``."""
    return consumed_samples + (micro_index * dp_size + dp_rank) * micro_batch_size


class BatchSampler:
    """This rank's micro-batches of each global batch, and the position to checkpoint.

    A step's global batch is `global_batch_size` unless the caller gives its own (a batch ramp,
    moe_train.batch_ramp); any multiple of micro_batch_size x dp_size is split as above."""

    def __init__(
        self,
        samples: SampleStream,
        global_batch_size: int,
        micro_batch_size: int,
        dp_size: int = 1,
        dp_rank: int = 0,
    ) -> None:
        if micro_batch_size < 1 or dp_size < 1:
            raise ValueError(f"micro_batch_size {micro_batch_size} and dp_size {dp_size} must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        self.samples = samples
        self.micro_batch_size = micro_batch_size
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.global_batch_size = self._checked(global_batch_size)
        self.consumed_samples = 0

    def _checked(self, global_batch_size: int | None) -> int:
        size = self.global_batch_size if global_batch_size is None else global_batch_size
        if size < 1 or size % (self.micro_batch_size * self.dp_size):
            raise ValueError(
                f"global_batch_size {size} must be a positive multiple of "
                f"micro_batch_size {self.micro_batch_size} x dp_size {self.dp_size}"
            )
        return size

    def microbatches(self, global_batch_size: int | None = None) -> list[torch.Tensor]:
        """This rank's micro-batches, rows ``(micro_batch_size, seq_length + 1)`` each, of the next global
        batch of ``global_batch_size`` samples (default: the sampler's); does not advance."""
        count = self._checked(global_batch_size) // (self.micro_batch_size * self.dp_size)
        return [self.samples.rows(microbatch_start(self.consumed_samples, self.micro_batch_size, self.dp_size,
                                                   self.dp_rank, i), self.micro_batch_size)
                for i in range(count)]

    def advance(self, global_batch_size: int | None = None) -> None:
        """Count the next global batch (default size: the sampler's) as consumed."""
        self.consumed_samples += self._checked(global_batch_size)

    def next_batch(self, global_batch_size: int | None = None) -> list[torch.Tensor]:
        """All of this rank's micro-batches of the next global batch, then advance past it."""
        batch = self.microbatches(global_batch_size)
        self.advance(global_batch_size)
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples, "data": self.samples.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("data")
        if saved is not None and saved != self.samples.fingerprint():
            warnings.warn(
                f"resuming the data position on different data or settings: saved {saved}, "
                f"now {self.samples.fingerprint()}; the sample order will not continue the saved run",
                stacklevel=2,
            )
        self.consumed_samples = int(state["consumed_samples"])
