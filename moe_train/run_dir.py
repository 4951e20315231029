"""One run per `logging.dir`: an advisory lock held for the whole run, and no silent mixing of runs.

The lock is `fcntl.flock` on `<logging.dir>/run.lock`, which also records the holder (host, pid,
start time) for the message a second run prints. The kernel drops the lock when its process dies,
so the lock of a dead run is simply taken over. A fresh start (`checkpoint.resume=none`) into a
directory with checkpoints is refused unless `logging.overwrite=true`, which renames the old run
aside (never deletes it).
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import IO

from moe_train.checkpoint import LATEST_FILE, list_iterations
from moe_train.config import Config

LOCK_FILE = "run.lock"


class RunDirError(RuntimeError):
    """The run directory is in use, cannot be created, or holds a run this start would mix with."""


class RunLock:
    """An acquired lock; `release` (or process exit) frees it."""

    def __init__(self, file: IO[str]) -> None:
        self.file = file

    def release(self) -> None:
        self.file.close()


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


def lock_run_dir(run_dir: str | os.PathLike) -> RunLock:
    """Create `run_dir` and take its lock, or RunDirError naming the holder."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        file = open(path, "a+")
    except OSError as err:
        raise RunDirError(f"logging.dir: cannot create {path}: {err.strerror}") from None
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.close()
        raise RunDirError(f"logging.dir: {run_dir} is in use by another run ({_holder(path)}); "
                          f"wait for it, stop it, or choose another logging.dir") from None
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    file.truncate(0)
    file.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started}) + "\n")
    file.flush()
    return RunLock(file)


def has_checkpoints(root: str | os.PathLike) -> bool:
    return bool(list_iterations(root)) or (Path(root) / LATEST_FILE).exists()


def _aside_name(path: Path, stamp: str) -> Path:
    return path.with_name(f"{path.name}.replaced-{stamp}")


def claim_run_dir(config: Config) -> RunLock:
    """Lock `logging.dir` for this run, then refuse or (with `logging.overwrite`) move aside an old
    run that `checkpoint.resume=none` would otherwise mix with; returns the held lock."""
    run_dir, checkpoints = Path(config.logging.dir), Path(config.checkpoint_dir)
    lock = lock_run_dir(run_dir)
    if config.checkpoint.resume != "none" or not has_checkpoints(checkpoints):
        return lock
    if not config.logging.overwrite:
        lock.release()
        raise RunDirError(f"checkpoint.resume=none but {checkpoints} holds checkpoints of an earlier run; resume it "
                          f"(checkpoint.resume=auto), choose another logging.dir, or set logging.overwrite=true "
                          f"to move the old run aside")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    moved = [run_dir] + ([] if checkpoints.resolve().is_relative_to(run_dir.resolve()) else [checkpoints])
    try:
        for path in moved:
            os.rename(path, _aside_name(path, stamp))
    except OSError as err:
        lock.release()
        raise RunDirError(f"logging.overwrite: cannot move {path} aside: {err.strerror}") from None
    new_lock = lock_run_dir(run_dir)
    lock.release()
    print(f"logging.overwrite: moved the old run to " + ", ".join(str(_aside_name(p, stamp)) for p in moved),
          flush=True)
    return new_lock
