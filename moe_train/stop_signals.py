"""The stop signals and their handling that needs no torch: the launcher's torchrun and the worker
entry point install handlers before torch is imported (seconds, during which a signal would end
the process or print a KeyboardInterrupt traceback). The agreed stop itself is moe_train.stop.
"""
from __future__ import annotations

import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def ignore_stop_signals() -> None:
    """Ignore stop signals from now on: for a process whose outcome is decided. Python's finalization
    gives handled signals their default action back, so a late SIGTERM would end it by the signal."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


class EarlySignals:
    """Stop signals noted while a process starts up, before its StopRequest exists: the first one is
    handed to it. A second Ctrl-C aborts at once, as later in the run."""

    def __init__(self) -> None:
        self.first: int | None = None

    def install(self) -> EarlySignals:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._note)
        return self

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        if self.first is None:
            self.first = signum
