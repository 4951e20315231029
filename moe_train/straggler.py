"""`logging.straggler_threshold`: which rank holds the others up.

In a synchronous job every rank's step takes as long as the slowest rank's, so step times cannot tell a
straggler: the others spend the difference waiting in collectives. What differs is the time a rank
computes. `ComputeClock` measures it per step as the wall time of the step's forward and backward (one
process's micro-batch loop; with pipeline stages, the runtime's compute actions, which leave out its
sends and receives) minus the host time blocked in the MoE all-to-alls (`OverlapSwitch.waited_s`). Outside
that phase lie the data-parallel gradient reduction, the loss and gradient-norm all-reduces and the
optimizer step with its ZeRO-1 all-gather; not separated: the `native` and `deepep` dispatchers wait
inside their kernels, which the host cannot tell from compute. On CUDA the clock is the host's, which
runs ahead of the GPU and meets it only at the MoE layers' split-size reads (those also wait for the EP
peers' counts), so there the figure is a host-side one, not the GPU's compute time.

At each log every rank gives its mean step and compute time since the previous log in one all-gather
of 2 floats per rank on the default process group (its timeout is `parallel.timeout_s`); host names and
pipeline stages are exchanged once at start-up. Ranks of one pipeline stage run the same layers on
other data, so each is compared with its stage's median (stages differ by design): the slowest rank of
a stage is named when its compute time is more than `threshold` above that median.
"""
from __future__ import annotations

import contextlib
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.dispatch.handles import OverlapSwitch
from parallel.grad_buffers import all_gather_flat


class ComputeClock:
    """This rank's compute seconds and steps since the last `take`."""

    def __init__(self, switch: OverlapSwitch) -> None:
        self.switch = switch
        self.seconds, self.steps = 0.0, 0

    @contextlib.contextmanager
    def phase(self, busy_s: Callable[[], float] | None = None) -> Iterator[None]:
        """Count the block as one step's compute phase: its wall time, or `busy_s()` read after it (the
        part of it that computed), less the time it blocked in waits through the switch."""
        waited, start = self.switch.waited_s, time.perf_counter()
        yield
        seconds = time.perf_counter() - start if busy_s is None else busy_s()
        self.seconds += seconds - (self.switch.waited_s - waited)
        self.steps += 1

    def take(self) -> tuple[float, int]:
        """(compute seconds, steps) since the previous call."""
        taken = self.seconds, self.steps
        self.seconds, self.steps = 0.0, 0
        return taken


@dataclass(frozen=True)
class RankTimes:
    rank: int
    host: str
    stage: int  # pipeline stage (pp rank)
    step_s: float  # mean wall time per step since the previous log
    compute_s: float  # mean compute time per step (ComputeClock)


@dataclass(frozen=True)
class Straggler:
    times: RankTimes
    median_s: float  # the median compute time of its stage's ranks
    ranks: int  # in its stage


def find_stragglers(times: list[RankTimes], threshold: float) -> list[Straggler]:
    """Per pipeline stage, its slowest rank when its compute time exceeds (1 + threshold) x the stage's median."""
    found = []
    for stage in sorted({t.stage for t in times}):
        peers = [t for t in times if t.stage == stage]
        median = statistics.median(t.compute_s for t in peers)
        slowest = max(peers, key=lambda t: t.compute_s)
        if median > 0 and slowest.compute_s > (1 + threshold) * median:
            found.append(Straggler(slowest, median, len(peers)))
    return found


def straggler_line(straggler: Straggler, step: int, threshold: float) -> str:
    t = straggler.times
    return (f"straggler at step {step}: rank {t.rank} on {t.host} computes {t.compute_s:.3f} s per step, "
            f"{t.compute_s / straggler.median_s:.2f}x the median {straggler.median_s:.3f} s of the "
            f"{straggler.ranks} ranks of pipeline stage {t.stage} (step {t.step_s:.3f} s; "
            f"logging.straggler_threshold={threshold:g})")


def rank_metrics(times: list[RankTimes]) -> dict[str, float]:
    """The metrics.jsonl keys of every rank's figures."""
    return {f"ranks/{t.rank}/{key}": getattr(t, key) for t in times for key in ("step_s", "compute_s")}


class RankTimesExchange:
    """The all-gather of every rank's times; made by every rank together (collective)."""

    def __init__(self, stage: int, device: torch.device) -> None:
        self.device = device
        self.places: list[tuple[str, int]] = [("", 0)] * dist.get_world_size()  # (host, stage) of each rank
        dist.all_gather_object(self.places, (socket.gethostname(), stage))

    def exchange(self, step_s: float, compute_s: float) -> list[RankTimes]:
        """Every rank's times, in rank order (one all-gather of 2 floats per rank, one host read)."""
        mine = torch.tensor([step_s, compute_s], dtype=torch.float64, device=self.device)
        every = mine.new_empty(len(self.places) * 2)
        all_gather_flat(every, mine)
        values = every.tolist()
        return [RankTimes(rank, host, stage, values[2 * rank], values[2 * rank + 1])
                for rank, (host, stage) in enumerate(self.places)]
