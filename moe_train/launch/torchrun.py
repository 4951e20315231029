"""`python -m moe_train.launch.torchrun ARGS`: torchrun (`torch.distributed.run`, the same arguments) that
passes stop signals on to its workers instead of ending them.

torchrun answers SIGTERM and SIGINT by signalling its workers, killing them 30 s later and exiting 1
with a `SignalException` traceback, however the workers ended; SIGUSR1 it does not handle, so that
signal ended torchrun alone. Here SIGTERM, SIGUSR1 and SIGINT go to every worker, once each (the
trainer's agreed stop: every rank saves the same step and exits 0) and torchrun keeps watching them,
so it exits 0 when all of them do. A Ctrl-C reaches torchrun only (its workers run in sessions of
their own), so each worker sees it once and a second Ctrl-C still aborts. SIGHUP and SIGQUIT keep
torchrun's own teardown. A stop signal before any worker has started ends torchrun at once; one after
the workers have ended changes nothing. A worker gets the signal only once its trainer notes stop
signals (its SigCgt shows SIGTERM and SIGUSR1 caught): one still importing torch would end by
SIGTERM or SIGUSR1, or print a KeyboardInterrupt traceback, so the signal waits for it; the run
then stops after its first step, which every rank saves.

When workers fail, torchrun raises `ChildFailedError`, a traceback and a table, and exits 1. Here the
workers' own status is passed on instead: 2, 3, 4 or 5 (moe_train.launch.exit_codes) when every failed worker
ended so, having said why in its one line; otherwise 1, with one line per failed worker naming its
rank, pid and exit code or signal. When the operating system refuses to start a worker (fork fails
for lack of memory or processes), torchrun raises that OSError and would leave the workers it had
already started waiting 60 s for a rendezvous that never comes: here they are killed, and one line
says what the system refused (exit 1).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from types import FrameType

from moe_train.launch.exit_codes import OWN_EXIT_STATUSES
from moe_train.launch.stop_signals import STOP_SIGNALS, ignore_stop_signals

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


def catches(pid: int, signums: tuple[int, ...]) -> bool:
    """Whether process `pid` has a handler for each of `signums` (the SigCgt mask of /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            line = next(line for line in status if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    mask = int(line.split()[1], 16)
    return all(mask >> (signum - 1) & 1 for signum in signums)


class SignalForwarder:
    """Each stop signal this process receives, passed on to every worker once the worker notes them."""

    READY = (signal.SIGTERM, signal.SIGUSR1)  # caught by a worker's trainer (Python itself catches SIGINT)

    def __init__(self, poll_s: float = 0.05) -> None:
        self.received: list[int] = []  # appended by the handler (main thread), read by the forwarding thread
        self.delivered: dict[int, int] = {}  # worker pid -> how many of `received` it has been sent
        self.poll_s = poll_s

    def start(self) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self.note)
        threading.Thread(target=self._forward, name="stop-signal forwarder", daemon=True).start()

    def note(self, signum: int, _frame: FrameType | None) -> None:
        workers = child_pids(os.getpid())
        if not workers and workers_have_ended():
            return  # torchrun is winding down after its workers: their outcome stands
        if not workers:
            print(f"{signal.Signals(signum).name} before any worker started: nothing to save, stopping",
                  file=sys.stderr, flush=True)
            raise SystemExit(128 + signum)
        self.received.append(signum)

    def _forward(self) -> None:
        while True:
            time.sleep(self.poll_s)
            count = len(self.received)
            if not count:
                continue
            for pid in child_pids(os.getpid()):
                sent = self.delivered.get(pid, 0)
                if sent < count and catches(pid, self.READY):
                    for signum in self.received[sent:count]:
                        try:
                            os.kill(pid, signum)
                        except ProcessLookupError:  # it has just exited
                            break
                    self.delivered[pid] = count


def failure_status(exit_codes: list[int]) -> int:
    """The launcher's status for workers that failed with `exit_codes`: theirs when they agree on one
    of the trainer's own statuses, else 1."""
    codes = set(exit_codes)
    return codes.pop() if len(codes) == 1 and codes <= set(OWN_EXIT_STATUSES) else 1


def describe_failure(rank: int, local_rank: int, pid: int, exit_code: int) -> str:
    ending = (f"was killed by {signal.Signals(-exit_code).name}" if exit_code < 0 and -exit_code in signal.valid_signals()
              else f"exited with status {exit_code}")
    return f"error: worker rank {rank} (local rank {local_rank}, pid {pid}) {ending}"


def not_a_failure_report(record: logging.LogRecord) -> bool:
    """Drops torchrun's own "failed (exitcode: ...)" line: the failure is said once, by the worker or below."""
    return not str(record.msg).startswith("failed (exitcode")


def main(argv: list[str]) -> None:
    SignalForwarder().start()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(not_a_failure_report)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun([f"--signals-to-handle={TORCHRUN_HANDLES}", *argv])
    except ChildFailedError as err:
        failures = sorted(err.failures.items())
        status = failure_status([failure.exitcode for _, failure in failures])
        if status == 1:
            for rank, failure in failures:
                print(describe_failure(rank, failure.local_rank, failure.pid, failure.exitcode), file=sys.stderr)
        raise SystemExit(status) from None
    except OSError as err:
        for pid in child_pids(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        print(f"error: the workers could not be started: {err}; the ones already started were stopped",
              file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        ignore_stop_signals()


if __name__ == "__main__":
    main(sys.argv[1:])
