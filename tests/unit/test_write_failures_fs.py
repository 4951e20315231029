"""Write failures on real file systems (tests/unit/_mounts.py): a full disk (ENOSPC) during a
checkpoint and while logging, and a read-only checkpoint folder (EROFS). Each stops the run with
exit 4 and one line naming the path and the error, and the previous checkpoint still loads.
(tests/unit/test_write_failures.py does the same with a file size limit, which needs no mount.)
As root, permission bits do not stop writes, so EACCES is not made here: a read-only mount is."""
from moe_train.checkpoint import iteration_dir, latest_iteration, list_iterations
from moe_train.train import EXIT_WRITE_FAILED, main
from tests.unit._mounts import make_read_only, tmpfs
from tests.unit.test_train import TINY, cache_dir, overrides, records  # noqa: F401 - cache_dir is a fixture

CHECKPOINT_MIB = 7  # one checkpoint of the tiny model (weights and Adam state) is about 6.6 MiB


def train(run, cache_dir, *extra) -> int:
    return main(["--config", TINY, *overrides(run, cache_dir, "train.log_interval=1", *extra)])


def loads_and_trains_on(checkpoint, tmp_path, cache_dir) -> bool:
    """Whether a fresh run (its own logging.dir and checkpoints) resumes from `checkpoint` and trains a step."""
    run = tmp_path / "check"
    step = int(checkpoint.name.split("_")[1])
    return train(run, cache_dir, f"train.steps={step + 1}", f"checkpoint.resume={checkpoint}") == 0 and \
        records(run)[-1]["step"] == step + 1


def test_a_full_disk_during_a_checkpoint_stops_with_one_line_and_the_previous_checkpoint_loads(
        tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    with tmpfs(tmp_path / "disk", f"{CHECKPOINT_MIB * 3 // 2}m") as disk:  # room for one checkpoint, not two
        common = ("checkpoint.interval=2", f"checkpoint.dir={disk}")
        assert train(run, cache_dir, "train.steps=2", *common) == 0
        capsys.readouterr()
        assert train(run, cache_dir, "train.steps=6", *common) == EXIT_WRITE_FAILED
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(f"error: saving {iteration_dir(disk, 4)}: "), line
        assert "No space left on device" in line and "the checkpoint needs about" in line, line
        assert latest_iteration(disk) == 2 and list_iterations(disk) == [2]
        assert loads_and_trains_on(iteration_dir(disk, 2), tmp_path, cache_dir)


def test_a_full_disk_while_logging_stops_with_one_line_naming_the_file(tmp_path, cache_dir, capsys):
    checkpoints = tmp_path / "checkpoints"
    with tmpfs(tmp_path / "run", "16k") as run:  # the lock file, config.yaml and two pages of metrics
        capsys.readouterr()
        assert train(run, cache_dir, "train.steps=200", "checkpoint.interval=5",
                     f"checkpoint.dir={checkpoints}") == EXIT_WRITE_FAILED
        assert capsys.readouterr().err.splitlines() == [
            f"error: cannot write {run / 'metrics.jsonl'}: No space left on device"]
        logged = (run / "metrics.jsonl").read_text().count("\n")
        assert 5 < logged < 200, logged
    kept = latest_iteration(checkpoints)
    assert kept == 5 * (logged // 5)  # the step whose record failed was not saved
    assert loads_and_trains_on(iteration_dir(checkpoints, kept), tmp_path, cache_dir)


def test_a_read_only_checkpoint_folder_stops_with_one_line_and_the_previous_checkpoint_loads(
        tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    with tmpfs(tmp_path / "disk", "32m") as disk:
        common = ("checkpoint.interval=2", f"checkpoint.dir={disk}")
        assert train(run, cache_dir, "train.steps=2", *common) == 0
        make_read_only(disk)
        capsys.readouterr()
        assert train(run, cache_dir, "train.steps=6", *common) == EXIT_WRITE_FAILED  # resumes from step 2
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(f"error: saving {iteration_dir(disk, 4)}: ") and "Read-only file system" in line, line
        assert latest_iteration(disk) == 2 and list_iterations(disk) == [2]
        assert [r["step"] for r in records(run)] == [1, 2, 3, 4]
        assert loads_and_trains_on(iteration_dir(disk, 2), tmp_path, cache_dir)
