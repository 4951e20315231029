"""Optional log backends: Weights & Biases in offline mode, and what happens when a package is missing."""
import glob
import io
import json
import struct
import sys
import time
from pathlib import Path

import pytest

from moe_train.metrics import TENSORBOARD_MISSING, MetricsLogger
from moe_train.train import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "moe_train/configs/tiny.yaml")


def run_args(run, *extra):
    sets = [f"logging.dir={run}", "train.threads=1", "logging.tensorboard=false", "data.demo_max_bytes=200000",
            f"data.cache_dir={run.parent / 'cache'}", *extra]
    return ["--config", TINY, *[a for kv in sets for a in ("--set", kv)]]


def offline_records(path):
    """The records of one offline run file, read from its transaction log (LevelDB's log format: 32 KiB
    blocks of chunks with a 7-byte header, after W&B's 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2

    data, block = Path(path).read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, record, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        record, pos = record + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            records.append(parsed)
            record = b""
    return records


def offline_history(path, timeout_s=60.0):
    """The `history` records of one offline run file, once W&B's service has written the run's `exit`
    record: `wandb.finish()` returns before the service has flushed the file (a read right after it
    found no history records in about one run of a hundred)."""
    deadline = time.monotonic() + timeout_s
    records = offline_records(path)
    while not (records and records[-1].WhichOneof("record_type") == "exit") and time.monotonic() < deadline:
        time.sleep(0.1)
        records = offline_records(path)
    assert records and records[-1].WhichOneof("record_type") == "exit", f"{path}: no exit record after {timeout_s} s"
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def offline_runs(run_dir) -> list[str]:
    return sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")))


def test_wandb_offline_logs_the_metrics_scalars(tmp_path, monkeypatch):
    """... and no file of the run directory (metrics, config, checkpoints, W&B's own) holds the W&B key."""
    pytest.importorskip("wandb")
    key = "0123456789abcdef0123456789abcdef0123test"
    monkeypatch.setenv("WANDB_API_KEY", key)
    run = tmp_path / "run"
    assert main(run_args(run, "train.steps=3", "train.log_interval=1", "logging.wandb_project=moe-test",
                         "logging.wandb_mode=offline")) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (path,) = offline_runs(run)
    history = offline_history(path)
    assert [h["_step"] for h in history] == [r["step"] for r in records] == [1, 2, 3]
    for logged, record in zip(history, records):
        for name in ("loss", "lm_loss", "mtp_loss", "aux_loss", "lr", "grad_norm", "consumed_samples"):
            assert logged[f"train/{name}"] == record[name], name
    holders = [str(f) for f in run.rglob("*") if f.is_file() and key.encode() in f.read_bytes()]
    assert holders == [] and (run / "checkpoints").is_dir()


def test_a_resumed_run_logs_on_into_the_same_wandb_run(tmp_path):
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    wandb = ("logging.wandb_project=moe-test", "logging.wandb_mode=offline", "train.log_interval=1",
             "checkpoint.interval=2")
    assert main(run_args(run, "train.steps=2", *wandb)) == 0
    assert main(run_args(run, "train.steps=4", *wandb)) == 0  # resumes from step 2 (checkpoint.resume=auto)
    paths = offline_runs(run)
    run_id = (run / "wandb" / "run_id").read_text().strip()
    assert [Path(p).stem for p in paths] == [f"run-{run_id}"] * 2  # one W&B run, in two folders
    steps = sorted([h["_step"] for h in offline_history(p)] for p in paths)  # (folders of one second sort by name)
    assert steps == [[1, 2], [3, 4]]


def test_wandb_project_without_wandb_exits_2_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    run = tmp_path / "run"
    assert main(run_args(run, "logging.wandb_project=p")) == 2
    err = capsys.readouterr().err
    assert err == ("error: logging.wandb_project: is 'p', but the wandb package is not installed: pip install wandb, "
                   "or unset the key\n")
    assert not run.exists()


def test_missing_tensorboard_is_said_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    out = io.StringIO()
    MetricsLogger(tmp_path, 10, enabled=True, tensorboard=True, stream=out).close()
    assert out.getvalue() == TENSORBOARD_MISSING + "\n"
    assert TENSORBOARD_MISSING.startswith("note: tensorboard is not installed") and "\n" not in TENSORBOARD_MISSING
    out = io.StringIO()
    MetricsLogger(tmp_path, 10, enabled=True, tensorboard=False, stream=out).close()
    assert out.getvalue() == ""
