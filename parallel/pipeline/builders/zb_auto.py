"""zb-auto: the Zero Bubble paper's automatic scheduling, a heuristic search under a memory limit.

Given F, B, W and communication costs and a limit on each rank's live activations (in one
stage's activations of one micro-batch; F allocates 1, B frees ``Costs.mem_b``, W the rest), it
builds several candidate schedules and keeps the one with the shortest simulated makespan:
the ZB-H2 list scheduler at the limit (under the costs' own memory model, each forward slack of
``FORWARD_SLACKS``), ZB-H2 counted in whole micro-batches in flight, and ZB-H1 when its peak fits.
The search is therefore never worse than ZB-H1 or ZB-H2 at the same limit.
"""
from __future__ import annotations

import math
from typing import Optional

from ..timeline import Costs
from .common import require
from .shape import Programs, ScheduleBuilder, Shape
from .zero_bubble import build_zb_h1, build_zb_h2, list_schedules, loop_timeline, shortest

_EPS = 1e-9


def default_memory_limit(ranks: int) -> float:
    """ZB-H2's cap: stage 0 keeps 2p-1 micro-batches so it never waits for the first B."""
    return float(2 * ranks - 1)


def _zb_auto(shape: Shape, costs: Optional[Costs], memory_limit: Optional[float] = None) -> Programs:
    """The shortest candidate (see the module docstring) whose peak fits ``memory_limit``
    (default ``default_memory_limit``). Requirements: ranks >= 1, microbatches >= 1,
    virtual_stages 1, memory_limit >= 1 (one forward's activations)."""
    limit = default_memory_limit(shape.ranks) if memory_limit is None else float(memory_limit)
    require(limit >= 1.0, "memory_limit", f"zb-auto needs memory_limit >= 1, got {memory_limit}")
    costs = costs or Costs()
    candidates = list_schedules(shape, costs, limit, costs.mem_b)
    handcrafted = [build_zb_h2.make(shape, costs, math.floor(limit)), build_zb_h1.make(shape, costs)]
    candidates += [
        programs
        for programs in handcrafted
        if max(loop_timeline(programs, shape, costs).peak_activations) <= limit + _EPS
    ]
    return shortest(candidates, shape, costs)


build_zb_auto = ScheduleBuilder("zb-auto", "loop", _zb_auto)


def parse_zb_costs(text: str) -> Costs:
    """``parallel.zb_costs``: "f,b,w,comm" (per stage and micro-batch; comm may be left out)."""
    parts = [part.strip() for part in text.split(",")]
    require(len(parts) in (3, 4), "zb_costs", f"expected 'f,b,w[,comm]', got {text!r}")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        raise ValueError(f"zb_costs: expected numbers in 'f,b,w[,comm]', got {text!r}") from None
    require(all(math.isfinite(v) for v in values), "zb_costs", f"must be finite, got {text!r}")
    f, b, w = values[:3]
    comm = values[3] if len(values) == 4 else 0.0
    try:
        return Costs(f=f, b=b, w=w, comm=comm)
    except ValueError as err:
        raise ValueError(f"zb_costs: {err}") from None
