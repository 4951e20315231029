"""Data blends as Megatron writes them: parsing, normalised weights, per-dataset counts, exact resume."""
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from moe_train.data import BatchSampler, BlendedSamples, DataError, IndexedDatasetWriter, build_datasets, parse_blend
from moe_train.data.blend import PERIOD
from moe_train.train import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "moe_train/configs/tiny.yaml")
EOD = 3


@pytest.fixture
def rng():
    seed = random.SystemRandom().randrange(2**32)
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


def write_dataset(prefix, rng, base, n_docs=30):
    """Documents of tokens in [base, base + 100) (then an EOD), so a row's tokens name its dataset."""
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for _ in range(n_docs):
            w.add_document(np.append(base + rng.integers(0, 100, int(rng.integers(5, 40))), EOD))
    return str(prefix)


def test_parse_one_prefix_a_blend_and_file_names():
    assert parse_blend("data/a") == [(1.0, "data/a")]
    assert parse_blend("data/a.bin") == parse_blend("data/a.idx") == [(1.0, "data/a")]
    assert parse_blend("3 a.bin 1 b") == [(0.75, "a"), (0.25, "b")]
    assert parse_blend(["0.3", "a", 0.7, "b"]) == parse_blend("0.3 a 0.7 b") == [(0.3, "a"), (0.7, "b")]
    assert parse_blend(Path("with space/a")) == [(1.0, "with space/a")]
    assert parse_blend("a.bin b") == parse_blend(["a", "b"]) == [(None, "a"), (None, "b")]  # weighted by size
    for bad, fragment in (("0.3 a 0.7", "neither one prefix nor a blend"), ("0.5 a b", "neither one prefix"),
                          ("0 a 1 b", "finite numbers > 0"), ("nan a 1 b", "finite numbers > 0"), ([], "is empty")):
        with pytest.raises(ValueError, match=fragment):
            parse_blend(bad)


def test_blend_draws_each_dataset_at_its_weight_in_its_own_order(tmp_path, rng):
    n_sets = int(rng.integers(2, 5))
    raw = rng.uniform(0.05, 1.0, n_sets)
    prefixes = [write_dataset(tmp_path / f"d{i}", rng, 1000 * (i + 1)) for i in range(n_sets)]
    spec = " ".join(f"{w} {p}" for w, p in zip(raw, prefixes))
    seed = int(rng.integers(1000))
    train, valid = build_datasets(spec, 8, seed)
    assert valid is None and isinstance(train, BlendedSamples)
    weights = raw / raw.sum()

    n = 2 * PERIOD + int(rng.integers(PERIOD))
    sources = np.array([train.source(g) for g in range(n)])
    for d in range(n_sets):
        mine = sources[:, 1][sources[:, 0] == d]
        assert mine.tolist() == list(range(mine.size)), d  # each dataset's own stream, in order, none skipped
        counts = np.cumsum(sources[:, 0] == d)
        ideal = weights[d] * np.arange(1, n + 1)
        bound = 1 + n_sets / 2 + np.arange(1, n + 1) / PERIOD
        assert np.all(np.abs(counts - ideal) <= bound), d
    assert train.draws(n) == [int((sources[:, 0] == d).sum()) for d in range(n_sets)]

    # A row is the row of the dataset the blend names (tokens tell the dataset), and
    # the stream alone decides it: the same seed gives the same rows, Megatron's unnormalised weights too.
    picks = rng.integers(0, n, 20)
    again, _ = build_datasets(" ".join(f"{10 * w} {p}.bin" for w, p in zip(raw, prefixes)), 8, seed)
    for g in picks:
        d, k = train.source(int(g))
        row = train.row(int(g))
        assert np.array_equal(row, train.parts[d].row(k))
        assert set(row[row != EOD] // 1000) == {d + 1}
        assert np.array_equal(row, again.row(int(g)))
    other, _ = build_datasets(spec, 8, seed + 1)
    assert not all(np.array_equal(train.row(int(g)), other.row(int(g))) for g in picks)


def test_prefixes_without_weights_are_blended_by_their_sizes(tmp_path, rng):
    small = write_dataset(tmp_path / "small", rng, 1000, n_docs=10)
    large = write_dataset(tmp_path / "large", rng, 2000, n_docs=40)
    train, _ = build_datasets(f"{small} {large}", 8, 5)
    sizes = np.array([part.samples_per_epoch for part in train.parts])
    assert train.weights == pytest.approx((sizes / sizes.sum()).tolist())
    assert train.draws(PERIOD) == train.slots.tolist() and sizes[1] > sizes[0]


def test_a_single_prefix_stream_is_unchanged_by_blending(tmp_path, rng):
    prefix = write_dataset(tmp_path / "one", rng, 1000)
    single, _ = build_datasets(prefix, 8, 5, 0.1, eod_id=EOD)
    also, _ = build_datasets(["1", prefix + ".idx"], 8, 5, 0.1, eod_id=EOD)
    assert np.array_equal(single.rows(0, 40).numpy(), also.rows(0, 40).numpy())


def test_valid_path_and_valid_fraction_of_a_blend(tmp_path, rng):
    a, b = write_dataset(tmp_path / "a", rng, 1000), write_dataset(tmp_path / "b", rng, 2000)
    v = write_dataset(tmp_path / "v", rng, 5000)
    train, valid = build_datasets(f"1 {a} 1 {b}", 8, 1, 0.2, eod_id=EOD)
    for split in (train, valid):  # valid_fraction splits every dataset of the blend, disjointly
        assert len(split.parts) == 2
    for t, w in zip(train.parts, valid.parts):
        assert set(t.documents.tolist()).isdisjoint(w.documents.tolist())
    train, valid = build_datasets(f"1 {a} 1 {b}", 8, 1, 0.2, eod_id=EOD, valid_path=v)
    assert [p.documents.size for p in train.parts] == [30, 30]  # valid_path: all of path trains
    assert set(valid.rows(0, 10).numpy().ravel().tolist()) - {EOD} <= set(range(5000, 5100))
    with pytest.raises(DataError, match=f"indexed dataset file not found: {tmp_path / 'nope'}.idx"):
        build_datasets(f"1 {a} 1 {tmp_path / 'nope'}", 8, 1)


def test_blend_resume_is_bit_exact_and_counts_are_printed(tmp_path, rng, capsys):
    """A blended run resumed from its middle checkpoint logs the straight run's losses bit for bit."""
    raw = rng.uniform(0.1, 1.0, 2)
    spec = " ".join(f"{w} {write_dataset(tmp_path / f'd{i}', rng, 10 * i + 1, n_docs=40)}" for i, w in enumerate(raw))
    common = ["--config", TINY, "--set", f"data.path={spec}", "--set", "train.steps=6", "--set", "train.log_interval=1",
              "--set", "checkpoint.interval=3", "--set", "train.threads=1", "--set", "logging.tensorboard=false",
              "--set", "data.valid_fraction=0"]
    straight = tmp_path / "straight"
    assert main([*common, "--set", f"logging.dir={straight}"]) == 0
    out = capsys.readouterr().out
    weights = raw / raw.sum()
    for i, w in enumerate(weights):
        line = next(x for x in out.splitlines() if x.startswith("data train:") and f"/d{i}," in x)
        drawn = int(line.split()[2])
        assert f"of 48 samples (weight {w:.4f})" in line and abs(drawn - 48 * w) <= 2, line

    resumed = tmp_path / "resumed"
    middle = shutil.copytree(straight / "checkpoints" / "iter_0000003", tmp_path / "saved" / "iter_0000003")
    assert main([*common, "--set", f"logging.dir={resumed}", "--set", f"checkpoint.resume={middle}"]) == 0
    assert "resumed from" in capsys.readouterr().out
    losses = lambda run: {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}  # noqa: E731
    expected, got = losses(straight), losses(resumed)
    assert sorted(got) == [4, 5, 6] and all(got[s] == expected[s] for s in got), (got, expected)


def test_the_sampler_position_of_a_blend_continues_after_resume(tmp_path, rng):
    spec = f"0.4 {write_dataset(tmp_path / 'a', rng, 1000)} 0.6 {write_dataset(tmp_path / 'b', rng, 2000)}"
    run = BatchSampler(build_datasets(spec, 8, 3)[0], 4, 2)
    for _ in range(int(rng.integers(1, 5))):
        run.next_batch()
    state, expected = run.state_dict(), [run.next_batch() for _ in range(2)]
    resumed = BatchSampler(build_datasets(spec, 8, 3)[0], 4, 2)
    resumed.load_state_dict(state)
    for batch in expected:
        assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(resumed.next_batch(), batch))
