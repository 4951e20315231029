"""`python -m moe_train.torchrun ARGS`: torchrun (`torch.distributed.run`, the same arguments) that
passes stop signals on to its workers instead of ending them.

torchrun answers SIGTERM and SIGINT by signalling its workers, killing them 30 s later and exiting 1
with a `SignalException` traceback, however the workers ended; SIGUSR1 it does not handle, so that
signal ended torchrun alone. Here SIGTERM, SIGUSR1 and SIGINT go to every worker, once each (the
trainer's agreed stop: every rank saves the same step and exits 0) and torchrun keeps watching them,
so it exits 0 when all of them do. A Ctrl-C reaches torchrun only (its workers run in sessions of
their own), so each worker sees it once and a second Ctrl-C still aborts. SIGHUP and SIGQUIT keep
torchrun's own teardown. A stop signal before any worker has started ends torchrun at once; one after
the workers have ended changes nothing.
"""
from __future__ import annotations

import os
import signal
import sys
from types import FrameType

from moe_train.stop import STOP_SIGNALS, ignore_stop_signals

TORCHRUN_HANDLES = "SIGHUP,SIGQUIT"  # torchrun --signals-to-handle: what its own teardown still answers


def child_pids(parent: int) -> list[int]:
    """The processes whose parent is `parent` (torchrun starts each worker as its own child)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # after "pid (command)": state, ppid, ...
        except (OSError, IndexError):  # not a process, or one that has just exited
            continue
        if int(fields[1]) == parent:
            pids.append(int(entry))
    return pids


def workers_have_ended() -> bool:
    """Whether workers of this process have run and been reaped (os.times counts their CPU time)."""
    times = os.times()
    return times.children_user + times.children_system > 0


def forward_to_workers(signum: int, _frame: FrameType | None) -> None:
    workers = child_pids(os.getpid())
    if not workers and workers_have_ended():
        return  # torchrun is winding down after its workers: their outcome stands
    if not workers:
        print(f"{signal.Signals(signum).name} before any worker started: nothing to save, stopping",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)
    for pid in workers:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # it has just exited
            pass


def main(argv: list[str]) -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, forward_to_workers)
    from torch.distributed.run import main as torchrun

    try:
        torchrun([f"--signals-to-handle={TORCHRUN_HANDLES}", *argv])
    finally:
        ignore_stop_signals()


if __name__ == "__main__":
    main(sys.argv[1:])
