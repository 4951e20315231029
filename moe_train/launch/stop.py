"""The agreed stop: SIGTERM, SIGUSR1 or SIGINT on any rank stops every rank after the same step.

A signal handler only notes the signal in its own process. Each step, every rank appends its vote
(1 once signalled, else 0) to the loss sums that the step all-reduces anyway, so the sum, the number
of signalled ranks, is the same on every rank: all of them stop after the same step, save it
together and exit 0. (A rank that decided alone could save step 5 while a peer signalled a moment
later was already in step 6's collectives: a deadlock.) The vote costs one more float64 in an
existing all-reduce and a host read that waits for that all-reduce only, not for the optimizer
step queued after it.

A second SIGINT (Ctrl-C twice) ends the process at once, without a save. A signal that came while
the process started up (moe_train.launch.stop_signals.SignalNotes) is taken over with `note`.
"""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator

import torch

from moe_train.launch.stop_signals import STOP_SIGNALS, SignalNotes


class StopRequest(SignalNotes):
    """This process's stop signal and the last step's vote count of all ranks."""

    def __init__(self) -> None:
        super().__init__()
        self._votes: torch.Tensor | None = None  # host copy of the last reduced vote count
        self._votes_ready: torch.cuda.Event | None = None

    @contextlib.contextmanager
    def handling_signals(self) -> Iterator[StopRequest]:
        """Note stop signals while the block runs (an in-process run); the previous handlers are back after it."""
        previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
        self.install()
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def with_vote(self, sums: torch.Tensor) -> torch.Tensor:
        """`sums` (1-D, about to be all-reduced over every rank) with this rank's vote appended."""
        vote = torch.full((1,), float(self.signum is not None), dtype=sums.dtype, device=sums.device)
        return torch.cat([sums, vote])

    def count(self, votes: torch.Tensor) -> None:
        """Keep the reduced vote count, copied to the host behind the all-reduce (no wait here)."""
        self._votes = votes.to("cpu", non_blocking=True)
        self._votes_ready = None
        if votes.is_cuda:
            self._votes_ready = torch.cuda.Event()
            self._votes_ready.record()

    def agreed(self) -> int:
        """The number of ranks that asked to stop by the last step's vote: the same on every rank, 0 to go on."""
        if self._votes is None:
            return 0
        if self._votes_ready is not None:
            self._votes_ready.synchronize()
        return round(self._votes.item())

    def reason(self, votes: int, world_size: int) -> str:
        """What stopped the run as this rank saw it, for the log line; `votes` as `agreed` returned."""
        if self.signum is not None:
            others = f" ({votes} of {world_size} processes signalled)" if world_size > 1 else ""
            return f"received {signal.Signals(self.signum).name}{others}"
        return f"a stop signal reached {votes} of {world_size} processes"
