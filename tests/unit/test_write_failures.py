"""Logs and checkpoints that cannot be written or read: a torn metrics line, a file size limit
during a checkpoint or a log write, garbage inside a checkpoint's data file."""
import json
import os
import subprocess
import sys

from moe_train.checkpoint import latest_iteration, list_iterations
from moe_train.train import EXIT_BAD_INPUT, EXIT_WRITE_FAILED, main
from tests.unit.test_train import ROOT, TINY, cache_dir, overrides, records  # noqa: F401 - cache_dir is a fixture


def run_limited(args: list[str], file_size_limit: int) -> subprocess.CompletedProcess:
    """The trainer in a subprocess whose files may not grow past `file_size_limit` bytes
    (RLIMIT_FSIZE: writes fail as on a full disk; Python ignores SIGXFSZ)."""
    code = ("import resource, sys; from moe_train.train import main; "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({file_size_limit}, {file_size_limit})); "
            f"sys.exit(main({['--config', TINY, *args]!r}))")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)


def test_torn_last_metrics_line_is_dropped_with_a_warning_on_resume(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    common = ("train.log_interval=1", "checkpoint.interval=2")
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=2", *common)]) == 0
    with open(run / "metrics.jsonl", "a") as file:
        file.write('{"step": 3, "loss": 4.1')  # a run stopped while writing step 3
    capsys.readouterr()
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=4", *common)]) == 0
    assert f"warning: {run / 'metrics.jsonl'}: dropped a torn last line (23 characters)" in capsys.readouterr().err
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4]


def test_garbage_in_the_middle_of_metrics_is_named_with_exit_2(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=2", "train.log_interval=1")]) == 0
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(["garbage", *lines]) + "\n")
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=3")]) == EXIT_BAD_INPUT
    assert f"{run / 'metrics.jsonl'}: line 1 is not a JSON record" in capsys.readouterr().err


def test_checkpoint_write_failure_stops_with_one_line_and_the_previous_checkpoint_loads(tmp_path, cache_dir):
    run = tmp_path / "run"
    common = ("train.log_interval=1", "checkpoint.interval=2")
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=2", *common)]) == 0
    result = run_limited(overrides(run, cache_dir, "train.steps=6", *common), 200_000)
    assert result.returncode == EXIT_WRITE_FAILED, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: saving {run / 'checkpoints' / 'iter_0000004'}: "), line
    assert "the file size limit, ulimit -f, is 200000 bytes" in line, line
    assert latest_iteration(run / "checkpoints") == 2 and list_iterations(run / "checkpoints") == [2]
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=4", *common)]) == 0
    assert latest_iteration(run / "checkpoints") == 4


def test_metrics_write_failure_stops_with_one_line_naming_the_file(tmp_path, cache_dir):
    run = tmp_path / "run"
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=2", "train.log_interval=1")]) == 0
    limit = (run / "config.yaml").stat().st_size + 20  # config.yaml is rewritten, metrics.jsonl outgrows it
    result = run_limited(overrides(run, cache_dir, "train.steps=30", "train.log_interval=1"), limit)
    assert result.returncode == EXIT_WRITE_FAILED, result.stderr
    assert result.stderr.splitlines() == [f"error: cannot write {run / 'metrics.jsonl'}: File too large"]
    *complete, torn = (run / "metrics.jsonl").read_text().splitlines()
    assert (run / "metrics.jsonl").stat().st_size == limit and not torn.endswith("}")  # cut at the limit
    steps = [json.loads(line)["step"] for line in complete]
    assert 2 < len(steps) < 30 and steps == list(range(1, len(steps) + 1)), steps
    assert latest_iteration(run / "checkpoints") == 2
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=3", "train.log_interval=1")]) == 0
    assert [r["step"] for r in records(run)] == [1, 2, 3]


def test_garbage_inside_a_data_file_of_its_original_size_exits_2_naming_the_checkpoint(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=1")]) == 0
    [data] = (run / "checkpoints" / "iter_0000001").glob("*.distcp")
    size = data.stat().st_size
    data.write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
    capsys.readouterr()
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=2")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith(f"error: loading {run / 'checkpoints' / 'iter_0000001'}: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
