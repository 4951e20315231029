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

When workers fail, torchrun raises `ChildFailedError`, a traceback and a table, and exits 1. Here the
workers' own status is passed on instead: 2, 3 or 4 (moe_train.exit_codes) when every failed worker
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
from types import FrameType

from moe_train.exit_codes import OWN_EXIT_STATUSES
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
    for signum in STOP_SIGNALS:
        signal.signal(signum, forward_to_workers)
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
