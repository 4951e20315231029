"""`logging.memory_snapshot`: the CUDA caching allocator's history from start-up through the first step.

Recording starts when the trainer has chosen its device, before the model is built, and the snapshot
is taken when the first step of the run has returned: every allocation and free up to then is in its
trace (the latest `MAX_ENTRIES`), so the first step's peak, and what was live at it, can be read off
with pytorch.org/memory_viz. Recording then stops, so later steps pay nothing. The file is published
atomically (moe_train.atomic). Whether this torch has the (private) API is probed, never read off its
version.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import torch

from moe_train.atomic import publish_bytes
from moe_train.metrics import LogWriteError

MAX_ENTRIES = 1_000_000  # allocator events kept, the latest first; a few KB of host memory each while recording
SNAPSHOT_API = ("_record_memory_history", "_snapshot")


def memory_snapshot_problem(device_type: str) -> str | None:
    """Why this process cannot record the allocator history on `device_type`, or None."""
    if device_type != "cuda":
        return f"true needs CUDA (the CUDA caching allocator's history); this run is on {device_type}"
    missing = [name for name in SNAPSHOT_API if not hasattr(torch.cuda.memory, name)]
    if missing:
        return f"true, but this torch has no torch.cuda.memory.{missing[0]} to record the allocator history"
    return None


def snapshot_path(run_dir: Path, rank: int, step: int) -> Path:
    return run_dir / "memory_snapshot" / f"rank{rank}_step{step}.pickle"


class MemorySnapshot:
    """Records from construction; `after_step` writes the snapshot once and stops recording."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.written: Path | None = None
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)

    def after_step(self, step: int) -> Path | None:
        """After the run's first step: write the snapshot and return its path; later calls do nothing."""
        if self.written is not None:
            return None
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.written = snapshot_path(self.run_dir, self.rank, step)
        try:
            self.written.parent.mkdir(parents=True, exist_ok=True)
            publish_bytes(self.written, pickle.dumps(snapshot))
        except OSError as err:
            raise LogWriteError(f"cannot write {self.written}: {err.strerror}") from err
        return self.written
