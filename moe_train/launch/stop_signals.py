"""The stop signals and their handling that needs no torch: the launcher's torchrun and the worker
entry point install handlers before torch is imported (seconds, during which a signal would end
the process or print a KeyboardInterrupt traceback). The agreed stop itself is moe_train.launch.stop.
"""
from __future__ import annotations

import signal
from types import FrameType
from typing import Self

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def ignore_stop_signals() -> None:
    """Ignore stop signals from now on: for a process whose outcome is decided. Python's finalization
    gives handled signals their default action back, so a late SIGTERM would end it by the signal."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


class SignalNotes:
    """The first stop signal this process received, noted by its handlers (`install`). A second Ctrl-C
    aborts at once, even inside a collective. moe_train.launch.stop.StopRequest adds the ranks' agreement;
    a process starting up uses this alone until torch is imported, then hands the signal over."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> Self:
        """Note stop signals from now on."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._note)
        return self

    def note(self, signum: int) -> None:
        """Take `signum` as received now (one noted before these handlers were installed)."""
        self._note(signum, None)

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        if self.signum is None:
            self.signum = signum
