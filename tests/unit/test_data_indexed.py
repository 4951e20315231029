"""Megatron indexed dataset format: round trips, corruption errors, vocab check, writer atomicity."""
import os
import random
import struct

import numpy as np
import pytest

from moe_train.data import DataError, IndexedDataset, IndexedDatasetWriter, check_vocab, token_dtype

MAGIC = b"MMIDIDX\x00\x00"
# Megatron's dtype codes, restated here independently of the implementation.
CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


@pytest.fixture
def rng():
    seed = random.SystemRandom().randrange(2**32)
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


def random_docs(rng, n, vocab):
    return [rng.integers(0, vocab, size=int(rng.integers(0, 40))) for _ in range(n)]


def write_with_writer(prefix, docs, dtype):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)


def write_independently(prefix, sequences, doc_idx, dtype):
    """A Megatron-layout file pair written with struct and numpy only."""
    code = {np.dtype(v): k for k, v in CODES.items()}[np.dtype(dtype)]
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = np.concatenate(([0], np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize)))
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sequences)) + struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes() + np.asarray(doc_idx, np.int64).tobytes())
    with open(prefix + ".bin", "wb") as f:
        for s in sequences:
            f.write(np.asarray(s, dtype=dtype).tobytes())


def test_writer_output_matches_megatron_layout(tmp_path, rng):
    vocab = int(rng.choice([300, 70000]))
    dtype = token_dtype(vocab)
    docs = random_docs(rng, int(rng.integers(1, 30)), vocab)
    prefix = str(tmp_path / "ds")
    write_with_writer(prefix, docs, dtype)

    raw = (tmp_path / "ds.idx").read_bytes()
    assert raw[:9] == MAGIC
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", raw, 9)
    assert (version, n_seq, n_doc) == (1, len(docs), len(docs) + 1)
    assert CODES[code] == (np.uint16 if vocab < 65500 else np.int32)
    off = 34
    lengths = np.frombuffer(raw, "<i4", n_seq, off)
    pointers = np.frombuffer(raw, "<i8", n_seq, off + 4 * n_seq)
    doc_idx = np.frombuffer(raw, "<i8", n_doc, off + 12 * n_seq)
    assert len(raw) == off + 12 * n_seq + 8 * n_doc
    assert lengths.tolist() == [len(d) for d in docs]
    assert doc_idx.tolist() == list(range(len(docs) + 1))
    tokens = np.frombuffer((tmp_path / "ds.bin").read_bytes(), CODES[code])
    for d, p, n in zip(docs, pointers, lengths):
        start = p // np.dtype(CODES[code]).itemsize
        assert tokens[start : start + n].tolist() == d.tolist()
    assert tokens.size == sum(len(d) for d in docs)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.int64])
def test_reader_loads_independently_written_file(tmp_path, rng, dtype):
    sequences = random_docs(rng, int(rng.integers(2, 25)), 250)
    # Several sequences per document, as Megatron writes for sentence-split data.
    cuts = np.sort(rng.choice(np.arange(1, len(sequences)), size=min(3, len(sequences) - 1), replace=False))
    doc_idx = [0, *cuts.tolist(), len(sequences)]
    prefix = str(tmp_path / "ext")
    write_independently(prefix, sequences, doc_idx, dtype)

    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == len(sequences) and ds.num_documents == len(doc_idx) - 1
    assert ds.document_indices.tolist() == doc_idx
    for i, s in enumerate(sequences):
        assert ds[i].tolist() == s.tolist()
    assert ds.num_tokens == sum(len(s) for s in sequences)


def test_writer_reader_round_trip(tmp_path, rng):
    docs = random_docs(rng, 50, 65499)
    prefix = tmp_path / "sub" / "rt"
    write_with_writer(prefix, docs, token_dtype(65499))
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [d.tolist() for d in docs]
    assert ds[-1].tolist() == docs[-1].tolist()
    with pytest.raises(IndexError):
        ds[len(docs)]


@pytest.fixture
def small_dataset(tmp_path, rng):
    prefix = str(tmp_path / "c")
    docs = [rng.integers(0, 250, size=int(rng.integers(3, 20))) for _ in range(8)]
    write_with_writer(prefix, docs, np.uint16)
    return prefix


def rewrite(path, mutate):
    data = bytearray(open(path, "rb").read())
    data = mutate(data)
    with open(path, "wb") as f:
        f.write(data)


def expect_error(prefix, path_fragment, words):
    with pytest.raises(DataError) as info:
        IndexedDataset(prefix)
    msg = str(info.value)
    assert path_fragment in msg, msg
    assert any(w in msg for w in words), msg


def test_truncated_bin(small_dataset):
    rewrite(small_dataset + ".bin", lambda d: d[:-2])
    expect_error(small_dataset, small_dataset + ".bin", ["truncated"])


def test_bin_with_extra_bytes(small_dataset):
    rewrite(small_dataset + ".bin", lambda d: d + b"\x00\x00")
    expect_error(small_dataset, small_dataset + ".bin", ["trailing"])


@pytest.mark.parametrize("cut", [5, 30, 40])
def test_truncated_idx(small_dataset, cut):
    rewrite(small_dataset + ".idx", lambda d: d[:cut])
    expect_error(small_dataset, small_dataset + ".idx", ["truncated"])


def test_wrong_magic(small_dataset):
    rewrite(small_dataset + ".idx", lambda d: b"TNTIDX\x00\x00\x00" + d[9:])
    expect_error(small_dataset, small_dataset + ".idx", ["magic"])


def test_bad_version_and_dtype_code(small_dataset):
    original = open(small_dataset + ".idx", "rb").read()
    rewrite(small_dataset + ".idx", lambda d: d[:9] + struct.pack("<Q", 2) + d[17:])
    expect_error(small_dataset, ".idx", ["version"])
    rewrite(small_dataset + ".idx", lambda d: bytearray(original[:17]) + bytes([9]) + original[18:])
    expect_error(small_dataset, ".idx", ["dtype code"])


def test_corrupt_pointer(small_dataset):
    n_seq = struct.unpack_from("<Q", open(small_dataset + ".idx", "rb").read(), 18)[0]
    ptr_off = 34 + 4 * n_seq + 8 * 3

    def bump(d):
        struct.pack_into("<q", d, ptr_off, struct.unpack_from("<q", d, ptr_off)[0] + 2)
        return d

    rewrite(small_dataset + ".idx", bump)
    expect_error(small_dataset, ".idx", ["sequence 3"])


def test_missing_files(small_dataset):
    os.remove(small_dataset + ".bin")
    expect_error(small_dataset, small_dataset + ".bin", ["not found"])
    os.remove(small_dataset + ".idx")
    expect_error(small_dataset, small_dataset + ".idx", ["not found"])


def test_check_vocab(tmp_path, rng):
    docs = random_docs(rng, 10, 1000)
    docs[int(rng.integers(0, 10))] = np.array([999, 3])
    prefix = str(tmp_path / "v")
    write_with_writer(prefix, docs, np.uint16)
    ds = IndexedDataset(prefix)
    check_vocab(ds, 1000)
    with pytest.raises(DataError, match=r"token id 999 is >= the model vocab size 999") as info:
        ds.check_vocab(999)
    assert prefix + ".bin" in str(info.value)


def test_writer_failure_leaves_nothing_under_final_name(tmp_path, rng):
    prefix = str(tmp_path / "atomic")
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            for d in random_docs(rng, 5, 100):
                w.add_document(d)
            raise RuntimeError("simulated crash")
    assert os.listdir(tmp_path) == []


def test_failed_rewrite_keeps_previous_dataset(tmp_path, rng):
    prefix = str(tmp_path / "keep")
    old = random_docs(rng, 4, 100)
    write_with_writer(prefix, old, np.uint16)
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document([1, 2, 3])
            raise RuntimeError("simulated crash")
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [d.tolist() for d in old]
    assert sorted(os.listdir(tmp_path)) == ["keep.bin", "keep.idx"]
