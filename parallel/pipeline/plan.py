"""The runtime's entry point: a named schedule, built, validated and lowered."""
from __future__ import annotations

from typing import Optional

from .builders import build
from .ir import LoweredSchedule
from .timeline import Costs
from .validate import validate


def plan(
    name: str,
    ranks: int,
    microbatches: int,
    virtual_stages: Optional[int] = None,
    costs: Optional[Costs] = None,
    memory_limit: Optional[float] = None,
) -> LoweredSchedule:
    """Per-rank programs for the runtime: ``plan(...).programs[rank]`` is that rank's sequence of
    compute actions and CommBatch groups (each batch is one batch_isend_irecv call).

    Every validator has accepted the result. ``costs`` (default: unit costs) shape both cost-driven
    builders and where communication is placed; any positive costs give a deadlock-free lowering.
    ``memory_limit`` is zb-auto's (see ``build``).
    """
    return validate(build(name, ranks, microbatches, virtual_stages, costs, memory_limit), costs)
