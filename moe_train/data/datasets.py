"""From a dataset prefix and the training settings to the train and valid sample streams."""
from __future__ import annotations

import os

from moe_train.data.indexed_dataset import IndexedDataset
from moe_train.data.packing import PackedSamples
from moe_train.data.sampler import split_documents


def build_datasets(
    prefix: str | os.PathLike,
    seq_length: int,
    seed: int,
    valid_fraction: float = 0.0,
    eod_id: int | None = None,
    split_seed: int = 0,
) -> tuple[PackedSamples, PackedSamples | None]:
    """Open ``prefix.idx``/``prefix.bin`` and return (train, valid) packed samples; valid is
    ``None`` when ``valid_fraction`` is 0."""
    dataset = IndexedDataset(prefix)
    train_docs, valid_docs = split_documents(dataset, valid_fraction, split_seed)
    train = PackedSamples(dataset, seq_length, seed, train_docs, eod_id, stream="train")
    valid = None
    if valid_docs.size:
        valid = PackedSamples(dataset, seq_length, seed, valid_docs, eod_id, stream="valid")
    return train, valid
