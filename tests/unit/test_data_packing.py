"""Packing into rows, the seeded global order, data-parallel slicing, resume and the split."""
import random
from collections import Counter

import numpy as np
import pytest
import torch

from moe_train.data import (
    BatchSampler,
    DataError,
    IndexedDataset,
    IndexedDatasetWriter,
    PackedSamples,
    build_datasets,
    microbatch_start,
    split_documents,
)

EOD = 7


@pytest.fixture
def rng():
    seed = random.SystemRandom().randrange(2**32)
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


def make_dataset(path, rng, n_docs=40, with_eod=True, max_len=30):
    """Documents whose tokens encode (document, position) so any row can be traced back."""
    docs = []
    for d in range(n_docs):
        n = int(rng.integers(1, max_len))
        body = 100 + d * 1000 + np.arange(n)
        docs.append(np.append(body, EOD) if with_eod else body)
    with IndexedDatasetWriter(path, np.int32) as w:
        for doc in docs:
            w.add_document(doc)
    return IndexedDataset(path), docs


def epoch_stream(samples, docs, epoch):
    parts = []
    for d in samples.document_order(epoch):
        doc = docs[d]
        parts.append(doc if doc[-1] == EOD else np.append(doc, EOD))
    return np.concatenate(parts)


def epoch_rows(samples, epoch):
    n = samples.samples_per_epoch
    return samples.rows(epoch * n, n).numpy()


@pytest.mark.parametrize("with_eod", [True, False])
def test_rows_are_the_eod_separated_concatenation(tmp_path, rng, with_eod):
    ds, docs = make_dataset(str(tmp_path / "p"), rng, with_eod=with_eod)
    seq = int(rng.integers(3, 40))
    samples = PackedSamples(ds, seq, seed=int(rng.integers(1000)), eod_id=EOD)
    for epoch in (0, 1):
        stream = epoch_stream(samples, docs, epoch)
        n = samples.samples_per_epoch
        assert n == (stream.size - 1) // seq
        rows = epoch_rows(samples, epoch)
        assert rows.shape == (n, seq + 1)
        expected = [stream[p * seq : p * seq + seq + 1].tolist() for p in range(n)]
        assert sorted(map(list, rows.tolist())) == sorted(expected)
        # Every stream token up to the dropped tail is a row input exactly once.
        assert Counter(rows[:, :-1].ravel().tolist()) == Counter(stream[: n * seq].tolist())
        assert stream.size - (n * seq + 1) < seq
    assert sorted(samples.document_order(0).tolist()) == list(range(len(docs)))


def test_without_eod_id_documents_are_joined_as_stored(tmp_path, rng):
    ds, docs = make_dataset(str(tmp_path / "e"), rng, with_eod=False)
    samples = PackedSamples(ds, 16, seed=3)
    stream = np.concatenate([docs[d] for d in samples.document_order(0)])
    rows = epoch_rows(samples, 0)
    assert samples.num_tokens == stream.size
    assert not np.any(rows == EOD)
    assert Counter(rows[:, :-1].ravel().tolist()) == Counter(stream[: rows.shape[0] * 16].tolist())


def test_same_seed_same_order_different_seed_different(tmp_path, rng):
    ds, _ = make_dataset(str(tmp_path / "s"), rng, n_docs=60)
    seed = int(rng.integers(1 << 30))
    a = PackedSamples(ds, 8, seed).rows(0, 40)
    b = PackedSamples(IndexedDataset(str(tmp_path / "s")), 8, seed).rows(0, 40)
    c = PackedSamples(ds, 8, seed + 1).rows(0, 40)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_epochs_are_reshuffled(tmp_path, rng):
    ds, _ = make_dataset(str(tmp_path / "r"), rng, n_docs=60)
    s = PackedSamples(ds, 8, int(rng.integers(1000)))
    assert not np.array_equal(s.document_order(0), s.document_order(1))
    assert not torch.equal(s.rows(0, 5), s.rows(s.samples_per_epoch, 5))


def test_too_little_data_for_one_row(tmp_path, rng):
    ds, _ = make_dataset(str(tmp_path / "t"), rng, n_docs=2, max_len=3)
    with pytest.raises(DataError, match="fewer than one row"):
        PackedSamples(ds, 100, 0)


def test_global_batch_is_independent_of_parallel_layout(tmp_path, rng):
    ds, _ = make_dataset(str(tmp_path / "l"), rng, n_docs=80)
    samples = PackedSamples(ds, 8, int(rng.integers(1000)))
    gbs, steps = 8, 3
    reference = samples.rows(0, gbs * steps)
    for micro, dp in [(8, 1), (2, 2), (1, 4), (2, 4), (1, 8)]:
        samplers = [BatchSampler(samples, gbs, micro, dp, r) for r in range(dp)]
        for step in range(steps):
            got = {}
            for r, sampler in enumerate(samplers):
                for i, mb in enumerate(sampler.next_batch()):
                    start = microbatch_start(step * gbs, micro, dp, r, i)
                    assert mb.shape == (micro, 9)
                    for j in range(micro):
                        got[start + j] = mb[j]
            assert sorted(got) == list(range(step * gbs, (step + 1) * gbs))
            for g, row in got.items():
                assert torch.equal(row, reference[g]), (micro, dp, g)


def test_resume_gives_the_same_following_batches(tmp_path, rng):
    prefix = str(tmp_path / "res")
    make_dataset(prefix, rng, n_docs=50)
    seed, k = int(rng.integers(1000)), int(rng.integers(1, 6))
    train, _ = build_datasets(prefix, 12, seed, 0.1, eod_id=EOD)
    run = BatchSampler(train, 4, 2, 1, 0)
    for _ in range(k):
        run.next_batch()
    state = run.state_dict()
    expected = [run.next_batch() for _ in range(3)]

    fresh_train, _ = build_datasets(prefix, 12, seed, 0.1, eod_id=EOD)
    resumed = BatchSampler(fresh_train, 4, 2, 1, 0)
    resumed.load_state_dict(state)
    assert resumed.consumed_samples == 4 * k
    for batch in expected:
        for a, b in zip(resumed.next_batch(), batch):
            assert torch.equal(a, b)


def test_train_valid_split_is_disjoint(tmp_path, rng):
    prefix = str(tmp_path / "split")
    ds, docs = make_dataset(prefix, rng, n_docs=50)
    frac = float(rng.uniform(0.05, 0.5))
    train_docs, valid_docs = split_documents(ds, frac, split_seed=int(rng.integers(100)))
    assert set(train_docs.tolist()).isdisjoint(valid_docs.tolist())
    assert sorted(train_docs.tolist() + valid_docs.tolist()) == list(range(50))
    assert len(valid_docs) == max(1, round(frac * 50))

    train, valid = build_datasets(prefix, 6, 1, frac, eod_id=EOD)
    owner = lambda rows: {(t - 100) // 1000 for t in rows.ravel().tolist() if t != EOD}  # noqa: E731
    train_owner = owner(train.rows(0, train.samples_per_epoch).numpy())
    valid_owner = owner(valid.rows(0, valid.samples_per_epoch).numpy())
    assert train_owner.isdisjoint(valid_owner)
    assert build_datasets(prefix, 6, 1, 0.0)[1] is None


def test_split_keeps_multi_sequence_documents_together(tmp_path):
    prefix = str(tmp_path / "multi")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for i in range(6):
            w.add_document([i + 1] * 3)
    # Rewrite the document index so sequences {0,1,2}, {3}, {4,5} are three documents.
    with open(prefix + ".idx", "r+b") as f:
        data = bytearray(f.read())
        data[26:34] = (4).to_bytes(8, "little")
        del data[34 + 12 * 6 :]
        data += np.array([0, 3, 4, 6], dtype="<i8").tobytes()
        f.seek(0)
        f.truncate()
        f.write(data)
    ds = IndexedDataset(prefix)
    for split_seed in range(6):
        train, valid = split_documents(ds, 0.34, split_seed)
        assert valid.tolist() in ([0, 1, 2], [3], [4, 5])
