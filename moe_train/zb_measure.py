"""zb-auto from measured costs (`parallel.schedule=zb-auto` without `parallel.zb_costs`).

The first `parallel.zb_measure_steps` steps run ZB-H1: 1F1B's order and activation memory, with the
backward split so that B and W are timed apart (a fused 1F1B backward cannot tell them). Each pipeline
rank times its F, B and W actions; the first step is not counted (allocations, first-touch). Then every
rank takes the slowest rank's mean per micro-batch (the pipeline runs at the pace of its slowest
stage), zb-auto's search runs on those costs in units of F, and the pipeline switches to its schedule.
The point-to-point time between stages is not measured: comm is 0 in the search.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_train.config import ParallelConfig
from parallel.pipeline import ActionKind, Costs
from parallel.pipeline.runtime import PipelineRuntime

WARMUP_SCHEDULE = "zb-h1"


def measures_zb_costs(parallel: ParallelConfig) -> bool:
    """Whether the trainer measures zb-auto's costs (a pipeline, zb-auto, no parallel.zb_costs)."""
    return parallel.pp > 1 and parallel.schedule == "zb-auto" and parallel.zb_costs is None
KINDS = (ActionKind.F, ActionKind.B, ActionKind.W)


@dataclass
class MeasuredCosts:
    seconds: tuple[float, float, float]  # mean F, B, W per micro-batch of the slowest rank

    @property
    def costs(self) -> Costs:
        """In units of F, as zb-auto's search takes them."""
        f, b, w = self.seconds
        return Costs(f=1.0, b=b / f, w=w / f)


class ZbCostMeter:
    """Collects a rank's action times over the warm-up steps; `measured` is collective (every rank)."""

    def __init__(self, steps: int) -> None:
        if steps < 2:
            raise ValueError(f"zb_measure_steps: needs at least 2 steps (the first is not timed), got {steps}")
        self.steps, self.seen = steps, 0
        self.total = {kind: 0.0 for kind in KINDS}
        self.count = {kind: 0 for kind in KINDS}

    @property
    def done(self) -> bool:
        return self.seen >= self.steps

    def record(self, runtime: PipelineRuntime) -> None:
        """After each warm-up step: its F, B and W times (the first step's are dropped)."""
        self.seen += 1
        if self.seen == 1:
            return
        for kind in KINDS:
            times = runtime.action_s.get(kind, [])
            self.total[kind] += sum(times)
            self.count[kind] += len(times)

    def measured(self, device: torch.device) -> MeasuredCosts:
        """The slowest rank's mean F, B and W (an all-reduce over every process)."""
        means = torch.tensor([self.total[k] / max(self.count[k], 1) for k in KINDS], dtype=torch.float64,
                             device=device)
        if dist.is_initialized():
            dist.all_reduce(means, op=dist.ReduceOp.MAX)
        return MeasuredCosts(tuple(means.tolist()))
