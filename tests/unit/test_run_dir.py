"""One run per logging.dir and checkpoint.dir: the locks, their takeover after a dead holder, a
checkpoint.dir that cannot be written, and starts that would mix with or destroy an earlier run's
checkpoints or metrics."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from moe_train.checkpoint.dcp import LATEST_FILE, iteration_dir, list_iterations
from moe_train.launch.run_dir import LOCK_FILE, aside_name, lock_run_dir
from moe_train.train import EXIT_BAD_INPUT, main
from tests.unit.test_train import TINY, cache_dir, overrides, records, run_cli  # noqa: F401 - cache_dir is a fixture

OLD_METRICS = '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n{"step": 3, "loss": 0.8}\n'


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def wait_for_records(run, count: int) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and len(records(run)) < count:
        time.sleep(0.05)


def test_second_run_stops_naming_the_holder_and_the_first_keeps_its_files(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    first = run_cli(overrides(run, cache_dir, "train.steps=100000", "train.log_interval=1", "checkpoint.interval=2"))
    try:
        wait_for_records(run, 2)
        metrics_inode, config_text = (run / "metrics.jsonl").stat().st_ino, (run / "config.yaml").read_text()
        code = main(["--config", TINY, *overrides(run, cache_dir, "train.steps=3", "train.seed=99")])
        err = capsys.readouterr().err
        assert code == EXIT_BAD_INPUT
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"{run} is in use by another run (pid {first.pid} on {socket.gethostname()}, started " in err, err
        logged = len(records(run))
        deadline = time.time() + 60
        while time.time() < deadline and len(records(run)) <= logged:
            time.sleep(0.05)
        assert len(records(run)) > logged  # the first run still writes the same metrics.jsonl
        assert (run / "metrics.jsonl").stat().st_ino == metrics_inode and (run / "config.yaml").read_text() == config_text
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == first.pid  # left behind by the killed run
    resumed_from = max(list_iterations(run / "checkpoints"))
    assert main(["--config", TINY, *overrides(run, cache_dir, f"train.steps={resumed_from + 1}")]) == 0
    assert records(run)[-1]["step"] == resumed_from + 1


def test_lock_of_a_dead_process_is_taken_over(tmp_path):
    pid = dead_pid()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "started": "earlier"}))
    lock = lock_run_dir(tmp_path)
    try:
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_fresh_start_into_a_run_with_checkpoints_is_refused_unless_overwrite_moves_it_aside(tmp_path, cache_dir,
                                                                                          capsys):
    run = tmp_path / "run"
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=2", "train.log_interval=1")]) == 0
    old_metrics = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    fresh = ("train.steps=1", "checkpoint.resume=none", "train.seed=7")
    assert main(["--config", TINY, *overrides(run, cache_dir, *fresh)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"checkpoint.resume=none but {run / 'checkpoints'} holds checkpoints" in err and "logging.overwrite=true" in err
    assert list_iterations(run / "checkpoints") == [2] and (run / "metrics.jsonl").read_text() == old_metrics
    assert main(["--config", TINY, *overrides(run, cache_dir, *fresh, "logging.overwrite=true")]) == 0
    [aside] = tmp_path.glob("run.replaced-*")
    assert f"moved the old run to {aside}" in capsys.readouterr().out
    assert list_iterations(aside / "checkpoints") == [2] and (aside / "metrics.jsonl").read_text() == old_metrics
    assert list_iterations(run / "checkpoints") == [1] and [r["step"] for r in records(run)] == [1]


def test_overwrite_needs_a_fresh_start(tmp_path, cache_dir, capsys):
    code = main(["--config", TINY, *overrides(tmp_path, cache_dir, "logging.overwrite=true")])
    assert code == EXIT_BAD_INPUT and "logging.overwrite: true needs checkpoint.resume=none" in capsys.readouterr().err


def test_logging_dir_that_cannot_be_created_exits_2_naming_it(tmp_path, cache_dir, capsys):
    (tmp_path / "file").write_text("")
    code = main(["--config", TINY, *overrides(tmp_path / "file" / "run", cache_dir, "train.steps=1")])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and f"logging.dir: cannot create {tmp_path / 'file' / 'run' / LOCK_FILE}" in err, err


def test_second_run_with_its_own_logging_dir_but_the_same_checkpoint_dir_stops_naming_the_holder(
        tmp_path, cache_dir, capsys):
    shared = tmp_path / "shared_checkpoints"
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    first = run_cli(overrides(run_a, cache_dir, "train.steps=100000", "train.log_interval=1", "checkpoint.interval=2",
                              f"checkpoint.dir={shared}"))
    try:
        wait_for_records(run_a, 3)
        kept = list_iterations(shared)
        code = main(["--config", TINY, *overrides(run_b, cache_dir, "train.steps=40", "checkpoint.interval=2",
                                                  f"checkpoint.dir={shared}")])
        err = capsys.readouterr().err
        assert code == EXIT_BAD_INPUT and err.count("\n") == 1 and "Traceback" not in err, err
        assert f"checkpoint.dir: {shared} is in use by another run (pid {first.pid} on {socket.gethostname()}, " \
               f"started " in err, err
        assert not (run_b / "metrics.jsonl").exists() and set(kept) <= set(list_iterations(shared)) and kept
        assert first.poll() is None  # the first run trains on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()


def test_iteration_folders_without_a_latest_file_are_refused_naming_them(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    common = ("train.log_interval=1", "checkpoint.interval=2")
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=4", *common)]) == 0
    (checkpoints / LATEST_FILE).unlink()
    inodes = {p.name: p.stat().st_ino for p in checkpoints.glob("iter_*/*")}
    metrics = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    for resume in ("auto", "none"):  # auto would start at step 0 over them, none would mix with them
        code = main(["--config", TINY, *overrides(run, cache_dir, "train.steps=6", *common,
                                                  f"checkpoint.resume={resume}")])
        err = capsys.readouterr().err
        assert code == EXIT_BAD_INPUT and err.count("\n") == 1 and "Traceback" not in err, err
        assert {p.name: p.stat().st_ino for p in checkpoints.glob("iter_*/*")} == inodes
        assert (run / "metrics.jsonl").read_text() == metrics
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=6", *common)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    newest = iteration_dir(checkpoints, 4)
    assert f"{checkpoints} holds iter_0000002, iter_0000004 but no {LATEST_FILE}" in err, err
    assert f"checkpoint.resume={newest}" in err and "checkpoint.resume=none and logging.overwrite=true" in err, err
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=5", *common,
                                              f"checkpoint.resume={newest}")]) == 0  # the advice works
    assert f"resumed from {newest} at step 4" in capsys.readouterr().out
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("resume", ["auto", "none"])
def test_fresh_start_moves_the_metrics_of_a_run_that_left_no_checkpoint_aside(tmp_path, cache_dir, capsys, resume):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(OLD_METRICS)  # a run that died before its first checkpoint
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=2", "train.log_interval=1",
                                              f"checkpoint.resume={resume}")]) == 0
    [aside] = run.glob("metrics.replaced-*.jsonl")
    assert aside.read_text() == OLD_METRICS
    assert f"note: {run / 'metrics.jsonl'} is from an earlier run that left no checkpoint; moved it to {aside}" \
        in capsys.readouterr().out
    assert [r["step"] for r in records(run)] == [1, 2]


def test_moving_aside_twice_in_one_second_keeps_both(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("first\n")
    first = aside_name(tmp_path / "metrics.jsonl", "20261201-180000")
    first.write_text("aside\n")
    second = aside_name(tmp_path / "metrics.jsonl", "20261201-180000")
    assert second.name == "metrics.replaced-20261201-180000-2.jsonl" and not second.exists()


def test_checkpoint_dir_that_cannot_be_created_stops_before_training(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    code = main(["--config", TINY, *overrides(run, cache_dir, "train.steps=2", "checkpoint.dir=/proc/ckpt")])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and err == "error: checkpoint.dir: cannot create /proc/ckpt/run.lock: " \
                                             "No such file or directory\n", err
    assert not (run / "metrics.jsonl").exists()  # nothing trained
