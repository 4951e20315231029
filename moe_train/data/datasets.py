"""From a dataset prefix or blend and the training settings to the train and valid sample streams."""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from moe_train.data.blend import BlendedSamples, parse_blend
from moe_train.data.errors import DataError
from moe_train.data.indexed_dataset import IndexedDataset
from moe_train.data.packing import PackedSamples, SampleStream
from moe_train.data.sampler import split_documents

DataPath = str | os.PathLike | Sequence[Any]


def build_datasets(
    path: DataPath,
    seq_length: int,
    seed: int,
    valid_fraction: float = 0.0,
    eod_id: int | None = None,
    split_seed: int = 0,
    valid_path: DataPath | None = None,
) -> tuple[SampleStream, SampleStream | None]:
    """(train, valid) sample streams of a prefix or blend (see ``blend.parse_blend``).

    Valid comes from ``valid_path`` when given (all of its documents), else from ``valid_fraction``
    of the documents of each dataset of ``path`` (blended with the same weights); ``None`` when
    both are unset or 0.
    """
    blend = _parse(path)
    datasets = [IndexedDataset(prefix) for _, prefix in blend]
    weights = [w for w, _ in blend]
    fraction = 0.0 if valid_path is not None else valid_fraction
    splits = [split_documents(ds, fraction, split_seed) for ds in datasets]
    train = _stream(datasets, weights, [t for t, _ in splits], seq_length, seed, eod_id, "train")
    if valid_path is not None:
        valid_blend = _parse(valid_path)
        valid_sets = [IndexedDataset(prefix) for _, prefix in valid_blend]
        return train, _stream(valid_sets, [w for w, _ in valid_blend], [None] * len(valid_sets),
                              seq_length, seed, eod_id, "valid")
    if not splits[0][1].size:
        return train, None
    return train, _stream(datasets, weights, [v for _, v in splits], seq_length, seed, eod_id, "valid")


def _parse(path: DataPath) -> list[tuple[float | None, str]]:
    try:
        return parse_blend(path)
    except ValueError as err:
        raise DataError(f"data path {err}") from None


def _stream(datasets: list[IndexedDataset], weights: list[float | None], documents: list[np.ndarray | None],
            seq_length: int, seed: int, eod_id: int | None, stream: str) -> SampleStream:
    """One dataset's packed stream as it always was, or a blend whose parts get their own orders."""
    if len(datasets) == 1:
        return PackedSamples(datasets[0], seq_length, seed, documents[0], eod_id, stream=stream)
    parts = [PackedSamples(ds, seq_length, seed, docs, eod_id, stream=f"{stream}/{i}")
             for i, (ds, docs) in enumerate(zip(datasets, documents))]
    if None in weights:  # prefixes without weights: each by its size in samples
        sizes = [part.samples_per_epoch for part in parts]
        weights = [size / sum(sizes) for size in sizes]
    return BlendedSamples(parts, weights, stream)


def describe_draws(samples: SampleStream, count: int, label: str) -> list[str]:
    """One line per dataset: how many of the first ``count`` samples of ``label`` it gives."""
    return [f"data {label}: {drawn} of {count} samples (weight {weight:.4f}) from {part.dataset.prefix}, "
            f"{drawn / part.samples_per_epoch:.2f} epochs of its {part.samples_per_epoch}"
            for part, weight, drawn in zip(samples.parts, samples.weights, samples.draws(count))]
