"""The stop request of one process (moe_train.launch.stop): which signals it notes, Ctrl-C twice, the vote
riding along the loss reduction, the host reads of the loop, and SIGINT on the command line.

Several ranks agreeing, and signals through the launcher, are in tests/distributed/test_signal_stop.py.
"""
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from moe_train.config import load_config
from moe_train.checkpoint.dcp import latest_iteration, list_iterations
from tests.host_syncs import HostSyncCounter
from tests.unit._checkpoint_writer import slowed_write
from moe_train.launch.stop import StopRequest
from moe_train.launch.stop_signals import STOP_SIGNALS
from moe_train.train import Trainer
from tests.unit.test_train import ROOT, TINY, cache_dir, overrides, records  # noqa: F401 - cache_dir is a fixture


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_stop_signal_is_noted_and_the_previous_handler_comes_back(signum):
    before = signal.getsignal(signum)
    with StopRequest().handling_signals() as stop:
        assert stop.signum is None
        os.kill(os.getpid(), signum)
        assert stop.signum == signum
        os.kill(os.getpid(), signal.SIGTERM if signum != signal.SIGTERM else signal.SIGUSR1)
        assert stop.signum == signum  # the first one is kept
    assert signal.getsignal(signum) is before


def test_a_second_ctrl_c_ends_the_process_at_once():
    """Two SIGINTs: the first is noted, the second gets the default action (the process ends, no traceback)."""
    code = ("import os, signal, time; from moe_train.launch.stop import StopRequest; stop = StopRequest().install(); "
            "os.kill(os.getpid(), signal.SIGINT); assert stop.signum == signal.SIGINT; print('noted', flush=True); "
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(30); print('not reached')")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGINT and result.stdout == "noted\n", result
    assert "Traceback" not in result.stderr


def test_the_vote_rides_along_the_reduced_sums_and_is_read_back():
    stop = StopRequest()
    sums = torch.tensor([1.5, 2.5], dtype=torch.float64)
    assert stop.with_vote(sums).tolist() == [1.5, 2.5, 0.0] and stop.agreed() == 0
    stop.signum = signal.SIGTERM
    voted = stop.with_vote(sums)
    assert voted.tolist() == [1.5, 2.5, 1.0] and voted.dtype == torch.float64
    stop.count(voted[-1] * 3)  # as if three ranks had voted
    assert stop.agreed() == 3
    assert stop.reason(3, 4) == "received SIGTERM (3 of 4 processes signalled)"
    assert StopRequest().reason(2, 4) == "a stop signal reached 2 of 4 processes"
    assert stop.reason(1, 1) == "received SIGTERM"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_reading_the_vote_waits_for_the_reduction_not_for_the_work_queued_after_it():
    stop = StopRequest()
    stop.count(torch.full((1,), 2.0, dtype=torch.float64, device="cuda")[0])
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles, queued after the vote
    later = torch.cuda.Event()
    later.record()
    assert stop.agreed() == 2
    assert not later.query()  # still running: the read did not wait for it
    torch.cuda.synchronize()


def signal_after_step(trainer: Trainer, step: int, signum: int) -> None:
    """Make `trainer` send `signum` to its own process right after step `step` (its vote already cast)."""
    train_step = trainer.train_step

    def step_then_signal() -> dict:
        metrics = train_step()
        if trainer.step == step:
            os.kill(os.getpid(), signum)
        return metrics

    trainer.train_step = step_then_signal


def test_the_loop_reads_the_stop_vote_once_per_step_and_stops_after_the_signalled_step(tmp_path, cache_dir):
    """The only host read the loop adds per step is the vote (no metrics are read between logs); on a
    GPU it waits for the loss all-reduce only. A vote stops the run after that step, with a save."""
    run = tmp_path / "run"
    trainer = Trainer(load_config(TINY, overrides(run, cache_dir, "train.steps=6", "train.log_interval=6",
                                                  "checkpoint.interval=0")[1::2]))
    signal_after_step(trainer, 3, signal.SIGUSR1)  # noted after step 3's vote: step 4 votes to stop
    with trainer.stop.handling_signals(), HostSyncCounter() as counter:
        assert trainer.train() == 0
    stop_reads = [s for s in counter.syncs if s.where.startswith("moe_train/launch/stop.py")]
    assert [s.kind for s in stop_reads] == ["item"] * 4, counter.report()
    assert latest_iteration(run / "checkpoints") == 4 and list_iterations(run / "checkpoints") == [4]
    assert records(run) == []  # stopped before the first log interval


def test_a_stop_signal_waits_for_the_background_save_before_exit_0(tmp_path, cache_dir, monkeypatch):
    """checkpoint.async_save with every tensor write 1 s late: the stop after step 4 saves it and returns
    only once that save is published (and the one of step 2 before it)."""
    run = tmp_path / "run"
    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", slowed_write(1.0))
    trainer = Trainer(load_config(TINY, overrides(run, cache_dir, "train.steps=20", "train.log_interval=20",
                                                  "checkpoint.interval=2", "checkpoint.async_save=true")[1::2]))
    signal_after_step(trainer, 3, signal.SIGUSR1)
    with trainer.stop.handling_signals():
        assert trainer.train() == 0
    assert trainer.step == 4
    assert latest_iteration(run / "checkpoints") == 4 and list_iterations(run / "checkpoints") == [2, 4]
    assert not list((run / "checkpoints").glob("*.tmp"))


def test_the_launcher_holds_a_stop_signal_until_a_starting_worker_notes_it():
    """moe_train.launch.torchrun's forwarder: a worker that installs its handlers 1 s after it starts (as one
    importing torch) gets the signal then, once, instead of being ended by it. Run in a fresh process,
    whose only child is that worker (the forwarder signals every child of its process)."""
    script = """
import signal, subprocess, sys, time
from moe_train.launch.torchrun import SignalForwarder
worker = subprocess.Popen([sys.executable, "-c",
    "import signal, sys, time\\n"
    "got = []\\n"
    "time.sleep(1.0)\\n"
    "signal.signal(signal.SIGTERM, lambda s, f: got.append(s))\\n"
    "signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))\\n"
    "time.sleep(1.5)\\n"
    "print('got', got)\\n"], stdout=subprocess.PIPE, text=True)
forwarder = SignalForwarder(poll_s=0.02)
forwarder.start()
time.sleep(0.3)
forwarder.note(signal.SIGUSR1, None)
out, _ = worker.communicate(timeout=30)
print(worker.returncode, out.strip())
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == f"0 got [{int(signal.SIGUSR1)}]", res.stdout + res.stderr
