"""Logs and checkpoints that cannot be written or read: a torn metrics line, metrics lines that are not
records, a file size limit during a checkpoint, a log write or the metrics rewrite of a resume, garbage
inside a checkpoint's files."""
import json
import os
import subprocess
import sys

import pytest

from moe_train.checkpoint.dcp import latest_iteration, list_iterations
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


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_checkpoint_write_failure_stops_with_one_line_and_the_previous_checkpoint_loads(tmp_path, cache_dir,
                                                                                        async_save):
    """With checkpoint.async_save the background write of step 4 fails: the run stops at a step boundary
    after it (step 5's, or step 6's on a loaded machine; not at the end of the run) with the same line,
    and nothing of step 4 is published."""
    run = tmp_path / "run"
    common = ("train.log_interval=1", "checkpoint.interval=2", f"checkpoint.async_save={str(async_save).lower()}")
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=2", *common)]) == 0
    result = run_limited(overrides(run, cache_dir, "train.steps=6", *common), 200_000)
    assert result.returncode == EXIT_WRITE_FAILED, result.stderr
    [line] = result.stderr.splitlines()
    assert max(r["step"] for r in records(run)) in ((4, 5) if async_save else (4,))  # stopped before the end
    assert line.startswith(f"error: saving {run / 'checkpoints' / 'iter_0000004'}: "), line
    assert "the file size limit, ulimit -f, is 200000 bytes" in line, line
    assert latest_iteration(run / "checkpoints") == 2 and list_iterations(run / "checkpoints") == [2]
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=4", *common)]) == 0
    assert latest_iteration(run / "checkpoints") == 4


def test_metrics_write_failure_stops_with_one_line_naming_the_file(tmp_path, cache_dir):
    run = tmp_path / "run"
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=2", "train.log_interval=1")]) == 0
    # config.yaml is rewritten within the limit; metrics.jsonl outgrows it two and a half records later
    record = max(len(line) + 1 for line in (run / "metrics.jsonl").read_text().splitlines())
    limit = max((run / "config.yaml").stat().st_size, (run / "metrics.jsonl").stat().st_size) + 5 * record // 2
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


def test_garbage_in_any_checkpoint_file_of_its_original_size_exits_2_naming_the_file(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=1")]) == 0
    folder = run / "checkpoints" / "iter_0000001"
    [data] = folder.glob("*.distcp")
    for file in (data, folder / "rng_rank0.pt", folder / "extra.pt", folder / ".metadata"):
        original = file.read_bytes()
        file.write_bytes(bytes(range(256)) * (len(original) // 256) + bytes(len(original) % 256))
        capsys.readouterr()
        assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=2")]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
        assert f"{file} is corrupt or not a checkpoint of this program (" in err, err
        assert "weights_only" not in err, err  # torch's advice to unpickle it unrestricted is not passed on
        file.write_bytes(original)
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=2")]) == 0


def test_metrics_lines_that_are_not_records_are_named_with_exit_2_and_kept(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=4", "train.log_interval=1")]) == 0
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    for bad, why in ((b'{"loss": 1.0}', "is not a metrics record"), (b"[1, 2]", "is not a metrics record"),
                     (b'{"step": "three"}', "is not a metrics record"), (b'{"step": 3, "x": "\xff\xfe"}',
                                                                         "is not UTF-8 text")):
        content = b"".join(lines[:2] + [bad + b"\n"] + lines[3:])
        (run / "metrics.jsonl").write_bytes(content)
        capsys.readouterr()
        assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=5")]) == EXIT_BAD_INPUT, bad
        err = capsys.readouterr().err
        assert err.startswith(f"error: {run / 'metrics.jsonl'}: line 3 {why}") and err.count("\n") == 1, err
        assert "Traceback" not in err and (run / "metrics.jsonl").read_bytes() == content


def test_metrics_rewrite_failing_on_resume_exits_4_and_leaves_the_file_and_no_temporary_file(tmp_path, cache_dir):
    run = tmp_path / "run"
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=2", "train.log_interval=1")]) == 0
    metrics = (run / "metrics.jsonl").read_text()
    result = run_limited(overrides(run, cache_dir, "train.steps=4", "train.log_interval=1"), len(metrics) - 10)
    assert result.returncode == EXIT_WRITE_FAILED, result.stderr
    assert result.stderr.splitlines() == [f"error: cannot write {run / 'metrics.jsonl'}: File too large"]
    assert (run / "metrics.jsonl").read_text() == metrics and not list(run.glob("*.tmp")), list(run.iterdir())
