"""Write failures on real file systems (tests/unit/_mounts.py): a full disk (ENOSPC) during a
checkpoint and while logging stops the run with exit 4 and one line naming the path and the error,
and the previous checkpoint still loads. A read-only checkpoint folder (EROFS), one where no file can
be created (no inodes left) and a full disk under a new logging.dir stop the run at start-up, before
training, with exit 2 and one line naming the folder or file.
(tests/unit/test_write_failures.py does the same with a file size limit, which needs no mount.)
As root, permission bits do not stop writes, so EACCES is not made here: a read-only mount is."""
from moe_train.checkpoint.dcp import iteration_dir, latest_iteration, list_iterations
from moe_train.launch.run_dir import LOCK_FILE
from moe_train.train import EXIT_BAD_INPUT, EXIT_WRITE_FAILED, main
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
        # the errno's text, or the cause named after torch's own "unexpected pos" (where the disk filled up)
        assert "no space left on device" in line.lower() and "the checkpoint needs about" in line, line
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


def test_a_read_only_checkpoint_folder_stops_at_start_up_and_its_checkpoint_still_loads(
        tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    with tmpfs(tmp_path / "disk", "32m") as disk:
        common = ("checkpoint.interval=2", f"checkpoint.dir={disk}")
        assert train(run, cache_dir, "train.steps=2", *common) == 0
        metrics = (run / "metrics.jsonl").read_text()
        make_read_only(disk)
        capsys.readouterr()
        assert train(run, cache_dir, "train.steps=6", *common) == EXIT_BAD_INPUT  # before training, not at a save
        assert capsys.readouterr().err.splitlines() == [
            f"error: checkpoint.dir: cannot create {disk / LOCK_FILE}: Read-only file system"]
        assert latest_iteration(disk) == 2 and list_iterations(disk) == [2]
        assert (run / "metrics.jsonl").read_text() == metrics
        assert loads_and_trains_on(iteration_dir(disk, 2), tmp_path, cache_dir)


def test_a_checkpoint_folder_where_no_file_can_be_created_stops_at_start_up(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    with tmpfs(tmp_path / "disk", "1m", inodes=8) as disk:
        (disk / LOCK_FILE).write_text("")  # left by an earlier run
        fillers = []
        try:
            while True:  # use up the inodes after run.lock: it can be rewritten, a checkpoint not created
                fillers.append(disk / f"user_file_{len(fillers)}")
                fillers[-1].write_text("kept\n")
        except OSError:
            fillers.pop()
        capsys.readouterr()
        assert train(run, cache_dir, "train.steps=2", f"checkpoint.dir={disk}") == EXIT_BAD_INPUT
        assert capsys.readouterr().err.splitlines() == [
            f"error: checkpoint.dir: cannot write files in {disk}: No space left on device"]
        assert not (run / "metrics.jsonl").exists() and all(f.read_text() == "kept\n" for f in fillers)


def test_a_new_run_on_a_full_disk_stops_with_one_line_naming_the_lock_file(tmp_path, cache_dir, capsys):
    with tmpfs(tmp_path / "disk", "64k") as disk:
        with open(disk / "user_data", "wb", buffering=0) as file:  # fill the disk
            try:
                while True:
                    file.write(bytes(4096))
            except OSError:
                pass
        size = (disk / "user_data").stat().st_size
        capsys.readouterr()
        assert train(disk / "run", cache_dir, "train.steps=2", f"checkpoint.dir={tmp_path / 'ck'}") == EXIT_BAD_INPUT
        assert capsys.readouterr().err.splitlines() == [
            f"error: logging.dir: cannot write {disk / 'run' / LOCK_FILE}: No space left on device"]
        assert (disk / "user_data").stat().st_size == size
