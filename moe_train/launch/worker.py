"""`python -m moe_train.launch.worker ARGS`: a training process as the launcher starts it; the trainer
(`moe_train.train`, the same arguments) with stop signals noted from the process's first instant.

`python -m moe_train.train` installs its handlers once its imports are done (torch, the model: a few
seconds), and a stop signal before that ends the process by the signal or with a KeyboardInterrupt
traceback, so the other ranks of the job fail too. Here the handlers come first: a signal during
start-up is kept and handed to the trainer, which stops after its first step, saved by every rank.
"""
from __future__ import annotations

import sys

from moe_train.launch.stop_signals import SignalNotes, ignore_stop_signals


def main(argv: list[str]) -> int:
    early = SignalNotes().install()
    from moe_train.launch.stop import StopRequest
    from moe_train.train import main as train

    stop = StopRequest().install()
    if early.signum is not None and stop.signum is None:
        stop.note(early.signum)
    status = train(argv, stop=stop)
    ignore_stop_signals()  # the outcome is decided; a late signal would end the process by it
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
