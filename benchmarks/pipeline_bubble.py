"""Measured pipeline bubble of the real runtime against the simulator's prediction.

    python -m benchmarks.pipeline_bubble [--ranks 4] [--microbatches 8] [--unit-ms 40]
        [--schedules 1f1b,zb-h1,...] [--cost-f 1 --cost-b 1 --cost-w 1]

Every schedule runs on `--ranks` gloo processes with synthetic stages whose F, B and W sleep for
calibrated times (cost x unit), so the processes need no CPU while "computing" and 2 cores are
enough. Each rank times its step, and the runtime its compute actions (busy, framework overhead
included); bubble = max over ranks of (makespan - busy), the simulator's definition, printed in
units next to the simulated bubble for the nominal costs (comm 0). A sleep lasts a little longer
than asked and every action has some framework overhead, and on a critical path those add to the
bubble of the ranks that wait, and so does the P2P latency. The fair model of the run simulates
with what the run measured: the mean time of each F, B and W (per-action overhead spread evenly)
and, as `comm`, half a `batch_isend_irecv` ping-pong between ranks 0 and 1 posted as the runtime
posts its batches. Both simulations are printed, each with the measured bubble's error against it.
The step time (makespan) is printed measured and simulated, in units.
Peak live activations per rank (micro-batches whose F ran and whose W or BW has not) are printed
against the simulator's peak. DualPipe(V) get twice the micro-batches (they need >= 2 x ranks).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.pipeline import SCHEDULES, Costs, LoweredSchedule, build, validate
from parallel.pipeline.runtime import PipelineRuntime
from parallel.pipeline.timeline import simulate
from parallel.pipeline.wgrad import WeightGradStore

SHAPE = (4,)


class Clock:
    """Sleeps for a cost in units; `spent[kind]` collects how long each sleep of that kind took."""

    def __init__(self, unit_s: float) -> None:
        self.unit_s = unit_s
        self.spent: dict[str, list[float]] = {"f": [], "b": [], "w": []}

    def work(self, kind: str, cost: float) -> None:
        start = time.perf_counter()
        time.sleep(cost * self.unit_s)
        self.spent[kind].append(time.perf_counter() - start)


class _SleepFunction(torch.autograd.Function):
    """Identity whose forward takes F, backward B, and whose queued weight-gradient work takes W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stage: "SleepStage") -> torch.Tensor:
        ctx.stage = stage
        stage.clock.work("f", stage.costs.f)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        stage = ctx.stage
        stage.clock.work("b", stage.costs.b)
        stage.store.put(lambda: stage.clock.work("w", stage.costs.w))
        return grad, None


class SleepStage:
    """A synthetic stage; the first one starts its graph from a parameter, the last returns a loss."""

    def __init__(self, first: bool, last: bool, clock: Clock, costs: Costs, store: WeightGradStore) -> None:
        self.first, self.last, self.clock, self.costs, self.store = first, last, clock, costs, store
        self.weight = torch.nn.Parameter(torch.ones(SHAPE))

    def forward(self, microbatch: int, x: Optional[torch.Tensor], inputs: Any) -> torch.Tensor:
        out = _SleepFunction.apply(self.weight * 1.0 if self.first else x, self)
        return out.sum() if self.last else out


def _p2p_latency_s(rounds: int = 50) -> float:
    """One activation's trip to another rank: half the mean ping-pong time between ranks 0 and 1."""
    rank, tensor = dist.get_rank(), torch.zeros(SHAPE)

    def exchange(op) -> None:
        for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, 1 - rank)]):
            work.wait()

    dist.barrier()
    start = time.perf_counter()
    if rank < 2:
        for _ in range(rounds):
            for op in ((dist.isend, dist.irecv) if rank == 0 else (dist.irecv, dist.isend)):
                exchange(op)
    latency = [(time.perf_counter() - start) / (2 * rounds)]
    dist.broadcast_object_list(latency, src=0)
    return latency[0]


def _measured_costs(lowered: LoweredSchedule, spans: list[tuple], unit_s: float, comm: float) -> Costs:
    """Mean F, B and W of the timed step in units, each with its share of the actions' overhead."""
    spent = {kind: [t for span in spans for t in span[4][kind]] for kind in ("f", "b", "w")}
    actions = sum(len(action.halves()) for program in lowered.schedule.programs for action in program)
    overhead = (sum(span[2] for span in spans) - sum(map(sum, spent.values()))) / actions
    return Costs(*(sum(times) / len(times) / unit_s + overhead / unit_s for times in spent.values()), comm=comm)


def _run_schedule(name: str, ranks: int, microbatches: int, costs: Costs, unit_s: float) -> dict:
    rank = dist.get_rank()
    lowered = validate(build(name, ranks, microbatches, costs=costs), costs)
    num_stages = lowered.schedule.num_stages
    clock, store = Clock(unit_s), WeightGradStore()
    stages = {s: SleepStage(s == 0, s == num_stages - 1, clock, costs, store)
              for s in lowered.schedule.placement.stages_on(rank)}
    runtime = PipelineRuntime(lowered, rank, stages, store, (SHAPE, torch.float32, torch.device("cpu")))
    inputs = [None] * microbatches
    runtime.step(inputs)
    comm = _p2p_latency_s() / unit_s
    clock.spent = {kind: [] for kind in clock.spent}
    dist.barrier()
    start = time.time()
    runtime.step(inputs)
    end = time.time()
    spans = [None] * ranks
    dist.all_gather_object(spans, (start, end, runtime.compute_s, runtime.peak_live, clock.spent))
    makespan = max(s[1] for s in spans) - min(s[0] for s in spans)
    timeline = simulate(lowered.schedule, costs)
    fair = simulate(lowered.schedule, _measured_costs(lowered, spans, unit_s, comm))
    return {
        "schedule": name, "ranks": ranks, "stages": num_stages, "microbatches": microbatches, "comm": comm,
        "measured": max(makespan - s[2] for s in spans) / unit_s, "simulated": timeline.bubble,
        "simulated_fair": fair.bubble, "step": makespan / unit_s, "simulated_step": timeline.makespan,
        "peak": [s[3] for s in spans], "simulated_peak": list(timeline.peak_activations),
    }


def _worker(rank: int, ranks: int, store_path: str, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=ranks,
                            timeout=timedelta(seconds=120))
    costs = Costs(args.cost_f, args.cost_b, args.cost_w)
    try:
        for name in args.schedules:
            microbatches = args.microbatches * (2 if name.startswith("dualpipe") else 1)
            result = _run_schedule(name, ranks, microbatches, costs, args.unit_ms / 1000)
            if rank == 0:
                queue.put(result)
    finally:
        dist.destroy_process_group()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline_bubble", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--unit-ms", type=float, default=100.0, help="wall time of one cost unit")
    parser.add_argument("--schedules", type=lambda s: s.split(","), default=list(SCHEDULES))
    parser.add_argument("--cost-f", type=float, default=1.0)
    parser.add_argument("--cost-b", type=float, default=1.0)
    parser.add_argument("--cost-w", type=float, default=1.0)
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(args.ranks, os.path.join(tmp, "store"), args, queue), nprocs=args.ranks,
                           start_method="spawn")
    print(f"bubble in units of {args.unit_ms:g} ms. sim: nominal costs, comm 0; fair: measured F/B/W and P2P "
          f"latency (comm); errors of the measured bubble against each")
    print(f"{'schedule':<17} {'ranks':>5} {'stages':>6} {'mb':>3} {'comm':>6} {'sim':>6} {'fair':>6} "
          f"{'measured':>8} {'err sim':>7} {'err fair':>8} {'step':>6} {'sim':>6}  peak activations per rank: "
          f"measured / simulated")
    while not queue.empty():
        r = queue.get()
        errors = [abs(r["measured"] - r[key]) / r[key] if r[key] else float("nan")
                  for key in ("simulated", "simulated_fair")]
        peaks = " ".join(f"{m}/{s:g}" for m, s in zip(r["peak"], r["simulated_peak"]))
        print(f"{r['schedule']:<17} {r['ranks']:>5} {r['stages']:>6} {r['microbatches']:>3} {r['comm']:>6.3f} "
              f"{r['simulated']:>6.2f} {r['simulated_fair']:>6.2f} {r['measured']:>8.2f} {100 * errors[0]:>6.1f}% "
              f"{100 * errors[1]:>7.1f}% {r['step']:>6.2f} {r['simulated_step']:>6.2f}  {peaks}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
