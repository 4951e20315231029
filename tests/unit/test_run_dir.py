"""One run per logging.dir: the lock, its takeover after a dead holder, and fresh starts that would
mix with an earlier run's checkpoints."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

from moe_train.checkpoint import list_iterations
from moe_train.run_dir import LOCK_FILE, lock_run_dir
from moe_train.train import EXIT_BAD_INPUT, main
from tests.unit.test_train import TINY, cache_dir, overrides, records, run_cli  # noqa: F401 - cache_dir is a fixture


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_second_run_stops_naming_the_holder_and_the_first_keeps_its_files(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    first = run_cli(overrides(run, cache_dir, "train.steps=100000", "train.log_interval=1", "checkpoint.interval=2"))
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(records(run)) < 2:
            time.sleep(0.05)
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
