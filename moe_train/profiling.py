"""`logging.profile_steps`: a torch.profiler trace of chosen steps on chosen ranks, written as a Chrome
trace (chrome://tracing, Perfetto, TensorBoard's profiler plugin) when the last of them ends."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from moe_train.atomic import publish_written


class StepProfiler:
    """Traces steps `first`..`last` (1-based, as the log counts them) on this rank when it is one of
    `ranks`; each step is a `step <n>` range in the trace. Without `steps`, or on other ranks, a no-op."""

    def __init__(self, steps: list[int] | None, ranks: list[int], rank: int, run_dir: Path,
                 device: torch.device) -> None:
        self.enabled = steps is not None and rank in ranks
        self.first, self.last = steps if steps is not None else (0, -1)
        self.path = run_dir / "profile" / f"rank{rank}_steps{self.first}-{self.last}.json"
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._profile: torch.profiler.profile | None = None

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Run step `number`, traced when it is one of the profiled steps; after the last one the trace
        is written (through a temporary file, so a stopped run never leaves half a trace)."""
        if not self.enabled or not self.first <= number <= self.last:
            yield
            return
        if self._profile is None:
            self._profile = torch.profiler.profile(activities=self.activities)
            self._profile.start()
        with torch.profiler.record_function(f"step {number}"):
            yield
        if number == self.last:
            self._profile.stop()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            publish_written(self.path, lambda tmp: self._profile.export_chrome_trace(str(tmp)))
            self._profile = None
            print(f"profile of steps {self.first}-{self.last} written to {self.path}", flush=True)
