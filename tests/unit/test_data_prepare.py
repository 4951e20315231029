"""scripts/prepare_data.py end to end (as a subprocess), its atomicity, and the demo corpus."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import moe_train.data.demo_corpus as demo_corpus
from moe_train.data import ByteTokenizer, IndexedDataset, build_demo_corpus, load_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "prepare_data.py"


def random_text(r, n):
    words = ["def", "return", "x", "café", "→", "😀", "loss", "expert", "\n", "    ", "{}", "1234"]
    return " ".join(r.choice(words) for _ in range(n))


@pytest.fixture
def corpus(tmp_path):
    """A folder of .txt files (plus files the glob or hiding must exclude) and a JSONL file."""
    r = random.Random(random.SystemRandom().randrange(2**32))
    folder = tmp_path / "in"
    (folder / "nested" / "deeper").mkdir(parents=True)
    (folder / ".hidden").mkdir()
    texts = {}
    for rel in ["b.txt", "a.txt", "nested/z.txt", "nested/deeper/m.txt"]:
        texts[rel] = random_text(r, r.randint(5, 60))
        (folder / rel).write_text(texts[rel], encoding="utf-8")
    (folder / "skip.md").write_text("not matched by the glob")
    (folder / ".hidden" / "h.txt").write_text("hidden")
    records = [random_text(r, r.randint(1, 40)) for _ in range(r.randint(3, 8))]
    lines = [json.dumps({"body": t, "id": i}) for i, t in enumerate(records)]
    lines.insert(1, "")
    lines.append(json.dumps({"body": ""}))
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(lines) + "\n", encoding="utf-8")
    expected = [texts[k] for k in sorted(texts, key=lambda k: Path(folder / k))] + records
    return folder, jsonl, expected


def run_prepare(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120
    )


def documents(prefix):
    ds = IndexedDataset(prefix)
    return ds, [ds[i].tolist() for i in range(len(ds))]


def test_prepare_byte_tokenizer(tmp_path, corpus):
    folder, jsonl, expected = corpus
    prefix = tmp_path / "out" / "ds"
    res = run_prepare(folder, jsonl, "-o", prefix, "--glob", "*.txt", "--json-key", "body")
    assert res.returncode == 0, res.stderr
    assert "docs" in res.stderr and "tokens" in res.stderr
    ds, docs = documents(str(prefix))
    assert ds.dtype == np.uint16
    assert docs == [list(t.encode("utf-8")) + [256] for t in expected]


def test_prepare_with_tokenizer_json_and_trained_bpe(tmp_path, corpus):
    folder, jsonl, expected = corpus
    prefix = tmp_path / "bpe"
    res = run_prepare(folder, jsonl, "-o", prefix, "--glob", "*.txt", "--json-key", "body",
                      "--train-bpe", 300, "--quiet")
    assert res.returncode == 0, res.stderr
    tok_path = tmp_path / "bpe.tokenizer.json"
    tok = load_tokenizer(str(tok_path))
    assert 257 <= tok.vocab_size <= 300
    ds, docs = documents(str(prefix))
    assert [d[-1] for d in docs] == [tok.eod_id] * len(expected)
    assert [tok.decode(d[:-1]) for d in docs] == expected
    assert sum(len(d) for d in docs) < sum(len(t.encode("utf-8")) + 1 for t in expected)
    ds.check_vocab(tok.vocab_size)

    again = tmp_path / "again"
    res = run_prepare(jsonl, "-o", again, "--tokenizer", tok_path, "--json-key", "body", "--quiet")
    assert res.returncode == 0, res.stderr
    assert documents(str(again))[1] == docs[-len(documents(str(again))[1]):]


def test_prepare_failure_midway_leaves_no_dataset(tmp_path):
    r = random.Random(random.SystemRandom().randrange(2**32))
    good = [json.dumps({"text": random_text(r, 20)}) for _ in range(600)]
    bad_line = r.randint(400, 599)
    good[bad_line] = '{"text": "unterminated'
    jsonl = tmp_path / "broken.jsonl"
    jsonl.write_text("\n".join(good) + "\n")
    out = tmp_path / "out"
    res = run_prepare(jsonl, "-o", out / "ds", "--quiet")
    assert res.returncode != 0
    assert f"broken.jsonl:{bad_line + 1}" in res.stderr
    assert not out.exists() or os.listdir(out) == []

    # A previous dataset and tokenizer under the same name survive a failed rebuild untouched.
    good_jsonl = tmp_path / "good.jsonl"
    good_jsonl.write_text("\n".join(good[:bad_line]) + "\n")
    assert run_prepare(good_jsonl, "-o", out / "ds", "--train-bpe", 280, "--quiet").returncode == 0
    before = {p: (out / p).read_bytes() for p in os.listdir(out)}
    assert sorted(before) == ["ds.bin", "ds.idx", "ds.tokenizer.json"]
    res = run_prepare(jsonl, "-o", out / "ds", "--train-bpe", 300, "--quiet")
    assert res.returncode != 0
    assert {p: (out / p).read_bytes() for p in os.listdir(out)} == before


def test_prepare_reports_missing_input_and_bad_json_key(tmp_path, corpus):
    res = run_prepare(tmp_path / "nothing-here", "-o", tmp_path / "x")
    assert res.returncode != 0 and "nothing-here" in res.stderr
    _, jsonl, _ = corpus
    res = run_prepare(jsonl, "-o", tmp_path / "x", "--json-key", "missing")
    assert res.returncode != 0 and "docs.jsonl:1" in res.stderr and "missing" in res.stderr
    assert not (tmp_path / "x.idx").exists()


def test_demo_corpus_is_built_once_and_keyed_by_tokenizer(tmp_path, monkeypatch):
    n = random.SystemRandom().randint(2, 6)
    tok = ByteTokenizer()
    prefix = build_demo_corpus(tmp_path, tok, max_files=n, max_bytes=200_000)
    sources = demo_corpus.stdlib_sources(max_files=n, max_bytes=200_000)
    assert len(sources) == n and all("site-packages" not in str(p) for p in sources)
    assert sum(p.stat().st_size for p in sources) <= 200_000
    _, docs = documents(prefix)
    assert docs == [list(p.read_bytes()) + [tok.eod_id] for p in sources if p.stat().st_size]

    stamp = os.stat(prefix + ".idx").st_mtime_ns

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached corpus was rebuilt")

    monkeypatch.setattr(demo_corpus, "write_dataset", no_rebuild)
    assert build_demo_corpus(tmp_path, tok, max_files=n, max_bytes=200_000) == prefix
    assert os.stat(prefix + ".idx").st_mtime_ns == stamp
    with pytest.raises(AssertionError, match="rebuilt"):
        build_demo_corpus(tmp_path, tok, max_files=n + 1, max_bytes=200_000)

    class OtherTokenizer(ByteTokenizer):
        def fingerprint(self):
            return "other"

    assert demo_corpus.demo_corpus_prefix(tmp_path, OtherTokenizer(), n, 200_000) != prefix
