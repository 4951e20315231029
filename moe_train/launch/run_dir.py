"""One run per `logging.dir` and `checkpoint.dir`: advisory locks held for the whole run, proof at
start-up that checkpoints can be written, and no silent mixing or loss of an earlier run's files.

The lock is `fcntl.flock` on `<logging.dir>/run.lock`, and on `<checkpoint.dir>/run.lock` unless the two
folders are one (two runs with their own logging.dir but one checkpoint.dir would resume and prune each
other's checkpoints). The file also records the holder (host, pid, start time) for the message a
second run prints. The kernel drops the lock when its process dies, so the lock of a dead run is simply
taken over. A fresh start (`checkpoint.resume=none`) into a directory with checkpoints is refused
unless `logging.overwrite=true`, which renames the old run aside (never deletes it); `iter_*` folders
without a latest file are refused for `checkpoint.resume=auto`, which would otherwise start over them.
A fresh start moves an earlier run's `metrics.jsonl` aside instead of truncating it.
Every refusal and failed start-up write here is a RunDirError: one line, exit 2, nothing written yet.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import IO

from moe_train.checkpoint.dcp import LATEST_FILE, iteration_dir, list_iterations
from moe_train.config import Config
from moe_train.metrics import METRICS_FILE

LOCK_FILE = "run.lock"


class RunDirError(RuntimeError):
    """The run directory is in use, cannot be created or written, or holds a run this start would mix with."""


class RunLock:
    """Acquired locks; `release` (or process exit) frees them."""

    def __init__(self, files: list[IO[str]]) -> None:
        self.files = files

    def release(self) -> None:
        for file in self.files:
            file.close()


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


def lock_run_dir(run_dir: str | os.PathLike, key: str = "logging.dir") -> RunLock:
    """Create `run_dir` and take its lock, or RunDirError starting with `key` (the option naming the
    folder) that names the holder or the error."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        file = open(path, "a+")
    except OSError as err:
        raise RunDirError(f"{key}: cannot create {path}: {err.strerror}") from None
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.close()
        raise RunDirError(f"{key}: {run_dir} is in use by another run ({_holder(path)}); "
                          f"wait for it, stop it, or choose another {key}") from None
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    try:
        file.truncate(0)
        file.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started}) + "\n")
        file.flush()
    except OSError as err:  # a full disk: the run could not write its logs either
        with contextlib.suppress(OSError):  # closing retries the write, and closes the file all the same
            file.close()
        raise RunDirError(f"{key}: cannot write {path}: {err.strerror}") from None
    return RunLock([file])


def _lock_both(run_dir: Path, checkpoints: Path) -> RunLock:
    """The locks of logging.dir and (when it is another folder) checkpoint.dir."""
    lock = lock_run_dir(run_dir)
    if checkpoints.resolve() == run_dir.resolve():
        return lock
    try:
        return RunLock(lock.files + lock_run_dir(checkpoints, "checkpoint.dir").files)
    except RunDirError:
        lock.release()
        raise


def prove_writable(folder: Path, key: str) -> None:
    """Write, fsync and remove a small file in `folder`, so that a checkpoint.dir that cannot take a
    checkpoint (read-only, full, not creatable) stops the run now rather than at its first save."""
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as file:
            file.write(b"probe\n")
            file.flush()
            os.fsync(file.fileno())
        probe.unlink()
    except OSError as err:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
        raise RunDirError(f"{key}: cannot write files in {folder}: {err.strerror}") from None


def has_checkpoints(root: str | os.PathLike) -> bool:
    return bool(list_iterations(root)) or (Path(root) / LATEST_FILE).exists()


def _stamp() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def aside_name(path: Path, stamp: str) -> Path:
    """`<name>.replaced-<stamp>` for a folder, `<stem>.replaced-<stamp><suffix>` for a file, with `-2`,
    `-3`, ... added when that name is taken, so that moving aside never replaces what an earlier move left."""
    stem, suffix = (path.stem, path.suffix) if path.is_file() else (path.name, "")
    candidate, number = path.with_name(f"{stem}.replaced-{stamp}{suffix}"), 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{stem}.replaced-{stamp}-{number}{suffix}")
    return candidate


def _move_aside(paths: list[Path], what: str) -> list[Path]:
    """Rename each of `paths` to its aside name; RunDirError starting with `what` if one cannot be moved."""
    stamp, moved = _stamp(), []
    for path in paths:
        aside = aside_name(path, stamp)
        try:
            os.rename(path, aside)
        except OSError as err:
            raise RunDirError(f"{what}: cannot move {path} aside: {err.strerror}") from None
        moved.append(aside)
    return moved


def _refuse_iterations_without_latest(checkpoints: Path) -> None:
    """resume=auto resumes from the latest file alone: without it, it would start at step 0 over these
    folders, overwrite them step by step and prune them."""
    steps = list_iterations(checkpoints)
    if not steps or (checkpoints / LATEST_FILE).exists():
        return
    names = ", ".join(iteration_dir(checkpoints, step).name for step in steps)
    raise RunDirError(f"checkpoint.dir: {checkpoints} holds {names} but no {LATEST_FILE}; resume one explicitly "
                      f"with checkpoint.resume={iteration_dir(checkpoints, steps[-1])}, or start fresh with "
                      f"checkpoint.resume=none and logging.overwrite=true (moves the old run aside)")


def _overwrite(config: Config, lock: RunLock) -> RunLock:
    """Move the old run (logging.dir, and checkpoint.dir when outside it) aside and lock the new, empty folders."""
    run_dir, checkpoints = Path(config.logging.dir), Path(config.checkpoint_dir)
    inside = checkpoints.resolve().is_relative_to(run_dir.resolve())
    moved = _move_aside([run_dir] + ([] if inside else [checkpoints]), "logging.overwrite")
    new_lock = _lock_both(run_dir, checkpoints)
    lock.release()
    print("logging.overwrite: moved the old run to " + ", ".join(map(str, moved)), flush=True)
    return new_lock


def _set_old_metrics_aside(run_dir: Path) -> None:
    """A fresh start would truncate the metrics.jsonl of an earlier run that left no checkpoint (one that
    died before its first save): it is moved aside instead, with a note."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return
    [aside] = _move_aside([path], "logging.dir")
    print(f"note: {path} is from an earlier run that left no checkpoint; moved it to {aside}", flush=True)


def claim_run_dir(config: Config) -> RunLock:
    """Lock `logging.dir` and `checkpoint.dir` for this run, refuse starts that would mix with or destroy
    an old run (or, with `logging.overwrite`, move it aside), prove checkpoint.dir writable and move an old
    run's metrics aside on a fresh start; returns the held locks."""
    run_dir, checkpoints = Path(config.logging.dir), Path(config.checkpoint_dir)
    lock = _lock_both(run_dir, checkpoints)
    try:
        resume = config.checkpoint.resume
        if resume == "none" and has_checkpoints(checkpoints):
            if not config.logging.overwrite:
                raise RunDirError(f"checkpoint.resume=none but {checkpoints} holds checkpoints of an earlier run; "
                                  f"resume it (checkpoint.resume=auto), choose another logging.dir, or set "
                                  f"logging.overwrite=true to move the old run aside")
            lock = _overwrite(config, lock)
        if resume == "auto":
            _refuse_iterations_without_latest(checkpoints)
        prove_writable(checkpoints, "checkpoint.dir")
        if resume == "none" or (resume == "auto" and not has_checkpoints(checkpoints)):
            _set_old_metrics_aside(run_dir)
    except RunDirError:
        lock.release()
        raise
    return lock
