"""Megatron-compatible indexed datasets: an atomic writer and a memory-mapped, validating reader.

On-disk format (identical to Megatron's ``MMapIndexedDataset``, so existing Megatron data loads):

``<prefix>.idx``, little endian:
    9 bytes   magic ``b"MMIDIDX\\x00\\x00"``
    <Q        version, 1
    <B        dtype code (see ``DTYPE_CODES``)
    <Q        number of sequences S
    <Q        number of document indices D (documents + 1)
    int32[S]  sequence lengths in tokens
    int64[S]  byte offset of each sequence in the .bin
    int64[D]  document indices: sequence index where each document starts, then S
``<prefix>.bin``: the tokens of all sequences back to back, in the dtype above.
"""
from __future__ import annotations

import array
import os
import struct
from typing import Sequence

import numpy as np

from moe_train.atomic import fsync_dir, temp_path_for
from moe_train.data.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # 34 bytes

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_CODES.items()}

# Megatron stores tokens as uint16 when the vocabulary is smaller than this, else int32.
UINT16_VOCAB_LIMIT = 65500
_CHECK_CHUNK = 1 << 20


def idx_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".idx"


def bin_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".bin"


def token_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron picks for a vocabulary of this size."""
    return np.dtype(np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32)


def dataset_exists(prefix: str | os.PathLike) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


class IndexedDatasetWriter:
    """Writes one document (one sequence) at a time; nothing appears under the final name until
    ``finalize``.

    Data goes to temporary files in the destination directory. ``finalize`` fsyncs them, removes
    any old ``.idx``, renames the ``.bin`` and then the ``.idx`` into place, so at every moment
    the final ``.idx`` either is absent or describes the ``.bin`` beside it. Used as a context
    manager it finalizes on success and deletes the temporary files on an exception.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise DataError(f"dtype {self.dtype} has no Megatron dtype code")
        self._tmp_bin = temp_path_for(bin_path(self.prefix))
        self._bin = open(self._tmp_bin, "xb")
        self._tmp_idx: str | None = None
        self._lengths = array.array("q")
        self.num_tokens = 0
        self._done = False

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        if self._done:
            raise RuntimeError(f"writer for {self.prefix} is already closed")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise DataError(f"{self.prefix}: a document must be a 1-D token sequence, got shape {arr.shape}")
        if arr.size and arr.dtype != self.dtype:
            info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
            if info is not None and (arr.min() < info.min or arr.max() > info.max):
                raise DataError(f"{self.prefix}: token ids out of range for dtype {self.dtype}")
        if arr.size >= 2**31:
            raise DataError(f"{self.prefix}: a document of {arr.size} tokens exceeds the int32 length field")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(arr.size)
        self.num_tokens += arr.size

    def finalize(self) -> None:
        if self._done:
            raise RuntimeError(f"writer for {self.prefix} is already closed")
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            self._write_index()
            final_idx, final_bin = idx_path(self.prefix), bin_path(self.prefix)
            if os.path.exists(final_idx):
                os.remove(final_idx)
            os.replace(self._tmp_bin, final_bin)
            os.replace(self._tmp_idx, final_idx)
            fsync_dir(os.path.dirname(os.path.abspath(final_idx)))
        except BaseException:
            self.abort()
            raise
        self._done = True

    def abort(self) -> None:
        """Delete the temporary files; the final names are left as they were."""
        self._done = True
        if not self._bin.closed:
            self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if path is not None and os.path.exists(path):
                os.remove(path)

    def _write_index(self) -> None:
        self._tmp_idx = temp_path_for(idx_path(self.prefix))
        lengths = np.frombuffer(self._lengths, dtype=np.int64) if self._lengths else np.zeros(0, np.int64)
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(lengths.size + 1, dtype=np.int64)
        with open(self._tmp_idx, "xb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[self.dtype], lengths.size, doc_idx.size))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        elif not self._done:
            self.abort()


class IndexedDataset:
    """Memory-mapped reader. Opening validates the header and that ``.idx`` and ``.bin`` agree."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        self.idx_path, self.bin_path = idx_path(prefix), bin_path(prefix)
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise DataError(f"indexed dataset file not found: {path}")
        self._read_index()
        self._map_tokens()
        self._max_token: int | None = None

    def _read_index(self) -> None:
        path = self.idx_path
        size = os.path.getsize(path)
        if size < HEADER.size:
            raise DataError(f"{path}: truncated index ({size} bytes, the header alone is {HEADER.size})")
        with open(path, "rb") as f:
            magic, version, code, n_seq, n_doc = HEADER.unpack(f.read(HEADER.size))
        if magic != MAGIC:
            raise DataError(f"{path}: not a Megatron MMapIndexedDataset index (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise DataError(f"{path}: unsupported index version {version} (only {VERSION} is known)")
        if code not in DTYPE_CODES:
            raise DataError(f"{path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER.size + 12 * n_seq + 8 * n_doc
        # Megatron's multimodal variant appends one int8 mode per sequence; it is ignored here.
        if size not in (expected, expected + n_seq):
            kind = "truncated" if size < expected else "corrupt"
            raise DataError(
                f"{path}: {kind} index: {size} bytes, but the header ({n_seq} sequences, "
                f"{n_doc} document indices) implies {expected}"
            )
        self._idx_map = np.memmap(path, dtype=np.uint8, mode="r")
        off = HEADER.size
        self.sequence_lengths = np.frombuffer(self._idx_map, dtype="<i4", count=n_seq, offset=off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(self._idx_map, dtype="<i8", count=n_seq, offset=off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(self._idx_map, dtype="<i8", count=n_doc, offset=off)
        self._check_index()

    def _check_index(self) -> None:
        path = self.idx_path
        n_seq, docs = len(self.sequence_lengths), self.document_indices
        if docs.size == 0 or docs[0] != 0 or docs[-1] != n_seq or np.any(np.diff(docs) < 0):
            raise DataError(f"{path}: corrupt index: document indices must rise from 0 to {n_seq}")
        itemsize, start = self.dtype.itemsize, 0
        # The pointers must be the running byte sums of the lengths; checked in chunks to bound memory.
        for lo in range(0, n_seq, _CHECK_CHUNK):
            lengths = self.sequence_lengths[lo : lo + _CHECK_CHUNK].astype(np.int64)
            if np.any(lengths < 0):
                raise DataError(f"{path}: corrupt index: negative sequence length")
            expected = start + np.concatenate(([0], np.cumsum(lengths[:-1] * itemsize)))
            bad = np.flatnonzero(self.sequence_pointers[lo : lo + _CHECK_CHUNK] != expected)
            if bad.size:
                i = lo + int(bad[0])
                raise DataError(
                    f"{path}: corrupt index: sequence {i} starts at byte {int(self.sequence_pointers[i])}, "
                    f"but the lengths before it put it at {int(expected[bad[0]])}"
                )
            start = int(expected[-1]) + int(lengths[-1]) * itemsize
        self.num_tokens = start // itemsize

    def _map_tokens(self) -> None:
        need = self.num_tokens * self.dtype.itemsize
        have = os.path.getsize(self.bin_path)
        if have != need:
            kind = "truncated" if have < need else "has trailing bytes, so it is not the data for this index"
            raise DataError(
                f"{self.bin_path}: {kind}: {have} bytes, but {self.idx_path} points to {need} "
                f"({self.num_tokens} tokens of {self.dtype})"
            )
        if need == 0:
            self.tokens = np.zeros(0, dtype=self.dtype)
        else:
            self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def token_offsets(self) -> np.ndarray:
        """Start of each sequence in ``self.tokens`` (in tokens, not bytes)."""
        return self.sequence_pointers // self.dtype.itemsize

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {self.prefix} ({n} sequences)")
        i %= n
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.sequence_lengths[i])]

    def max_token_id(self) -> int:
        """Largest token id in the ``.bin`` (one pass over the mmap, then cached); -1 if empty."""
        if self._max_token is None:
            self._max_token = int(self.tokens.max()) if self.tokens.size else -1
        return self._max_token

    def check_vocab(self, max_vocab: int) -> None:
        """Raise ``DataError`` unless every token id is in ``[0, max_vocab)``."""
        check_vocab(self, max_vocab)


def check_vocab(dataset: IndexedDataset, max_vocab: int) -> None:
    """Raise ``DataError`` if some token id of the dataset does not fit a model vocabulary of
    ``max_vocab``; the trainer calls this before the first step."""
    if dataset.dtype.kind == "f":
        raise DataError(f"{dataset.bin_path}: tokens are stored as {dataset.dtype}, not integers")
    top = dataset.max_token_id()
    if top >= max_vocab:
        pos = int(np.argmax(dataset.tokens >= max_vocab))
        raise DataError(
            f"{dataset.bin_path}: token id {top} is >= the model vocab size {max_vocab} (first offending "
            f"token at offset {pos}); the data was tokenized with a larger vocabulary than the model has"
        )
    if dataset.dtype.kind == "i" and dataset.tokens.size and int(dataset.tokens.min()) < 0:
        raise DataError(f"{dataset.bin_path}: negative token ids")
