"""Packing documents into fixed-length rows, with a seeded order that depends only on the seed.

Each epoch, the documents are shuffled and concatenated into one token stream (an EOD follows
every document), and the stream is cut Megatron-style into rows of ``seq_length + 1`` tokens
where row ``p`` is ``stream[p * seq_length : (p + 1) * seq_length + 1]``: consecutive rows share
one token, so every stream token except the first is a label exactly once. The rows of the epoch
are then shuffled. Rows are plain causal sequences: documents in one row may attend to each other
(no per-document mask or position reset), as in DeepSeek-V3 pretraining. The tail of an epoch
shorter than a row is dropped; the next epoch's shuffle packs it differently.

Global sample ``g`` is row ``g % samples_per_epoch`` of epoch ``g // samples_per_epoch`` in that
shuffled order, so the sample sequence is fixed by the seed and the data alone, whatever the
parallel layout that consumes it.
"""
from __future__ import annotations

import zlib
from collections import OrderedDict

import numpy as np
import torch

from moe_train.data.errors import DataError
from moe_train.data.indexed_dataset import IndexedDataset

_DOC_ORDER, _ROW_ORDER = 0, 1
_CACHED_EPOCHS = 2


def seeded_rng(seed: int, *keys: int) -> np.random.Generator:
    """An independent generator for each (seed, keys), the same on every rank and platform."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *keys])))


class SampleStream:
    """An endless sequence of rows of ``seq_length + 1`` tokens, drawn from ``parts`` with ``weights``."""

    seq_length: int
    parts: list[PackedSamples]
    weights: list[float]

    def row(self, index: int) -> np.ndarray:
        raise NotImplementedError

    def draws(self, count: int) -> list[int]:
        """Samples drawn from each of ``parts`` by the first ``count`` global samples."""
        raise NotImplementedError

    def fingerprint(self) -> dict[str, object]:
        """What the sample order depends on, saved with the data position to warn on a changed resume."""
        raise NotImplementedError

    def rows(self, start: int, count: int) -> torch.Tensor:
        """Global samples ``[start, start + count)`` as a ``(count, seq_length + 1)`` int64 tensor.

        Inputs are ``rows[:, :-1]`` and labels ``rows[:, 1:]``.
        """
        out = np.empty((count, self.seq_length + 1), dtype=np.int64)
        for i in range(count):
            out[i] = self.row(start + i)
        return torch.from_numpy(out)


class PackedSamples(SampleStream):
    """An endless, seeded sequence of packed rows over some documents of an indexed dataset.

    ``documents`` selects sequence indices of the dataset (all by default); like Megatron's GPT
    dataset, each stored sequence counts as one document. With ``eod_id`` set, an EOD is added
    after any document that does not already end with one (data prepared by ``prepare_data.py``
    or Megatron's ``--append-eod`` already does). ``stream`` names the role ("train", "valid") so
    different splits with the same seed get unrelated orders.
    """

    def __init__(
        self,
        dataset: IndexedDataset,
        seq_length: int,
        seed: int,
        documents: np.ndarray | None = None,
        eod_id: int | None = None,
        stream: str = "train",
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.dataset = dataset
        self.seq_length = seq_length
        self.seed = seed
        self.eod_id = eod_id
        self.stream = stream
        self._salt = zlib.crc32(stream.encode("utf-8"))
        docs = np.arange(len(dataset), dtype=np.int64) if documents is None else np.asarray(documents, np.int64)
        lengths = dataset.sequence_lengths[docs].astype(np.int64)
        keep = lengths > 0
        self.documents = docs[keep]
        self._lengths = lengths[keep]
        self._offsets = dataset.token_offsets()[self.documents]
        if eod_id is None:
            self._add_eod = np.zeros(self.documents.size, dtype=bool)
        else:
            self._add_eod = dataset.tokens[self._offsets + self._lengths - 1] != eod_id
        self._packed_lengths = self._lengths + self._add_eod
        self.num_tokens = int(self._packed_lengths.sum())
        self.samples_per_epoch = (self.num_tokens - 1) // seq_length
        if self.samples_per_epoch < 1:
            raise DataError(
                f"{dataset.prefix}: the {stream} split has {self.num_tokens} tokens in "
                f"{self.documents.size} documents, fewer than one row of seq_length + 1 = {seq_length + 1}"
            )
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def document_order(self, epoch: int) -> np.ndarray:
        """Dataset sequence indices in the order they are concatenated in ``epoch``."""
        return self.documents[self._epoch(epoch)[0]]

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document permutation, cumulative packed lengths in that order, row permutation)."""
        if epoch in self._epochs:
            self._epochs.move_to_end(epoch)
            return self._epochs[epoch]
        perm = seeded_rng(self.seed, self._salt, epoch, _DOC_ORDER).permutation(self.documents.size)
        ends = np.cumsum(self._packed_lengths[perm])
        rows = seeded_rng(self.seed, self._salt, epoch, _ROW_ORDER).permutation(self.samples_per_epoch)
        self._epochs[epoch] = (perm, ends, rows)
        while len(self._epochs) > _CACHED_EPOCHS:
            self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def row(self, index: int) -> np.ndarray:
        """Global sample ``index`` as an int64 array of ``seq_length + 1`` tokens."""
        if index < 0:
            raise IndexError(f"sample index must be >= 0, got {index}")
        epoch, local = divmod(index, self.samples_per_epoch)
        perm, ends, rows = self._epoch(epoch)
        pos = int(rows[local]) * self.seq_length
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        filled = 0
        k = int(np.searchsorted(ends, pos, side="right"))
        while filled < out.size:
            doc = int(perm[k])
            doc_start = int(ends[k]) - int(self._packed_lengths[doc])
            skip = pos + filled - doc_start
            take = min(out.size - filled, int(self._packed_lengths[doc]) - skip)
            real = max(0, min(take, int(self._lengths[doc]) - skip))
            if real:
                src = int(self._offsets[doc]) + skip
                out[filled : filled + real] = self.dataset.tokens[src : src + real]
            if take > real:
                out[filled + real : filled + take] = self.eod_id
            filled += take
            k += 1
        return out

    @property
    def parts(self) -> list[PackedSamples]:
        return [self]

    @property
    def weights(self) -> list[float]:
        return [1.0]

    def draws(self, count: int) -> list[int]:
        return [count]

    def fingerprint(self) -> dict[str, object]:
        return {"seed": self.seed, "seq_length": self.seq_length, "num_tokens": self.num_tokens, "stream": self.stream}
