"""Schedule builders (compute actions only) and the name -> builder registry.

Every builder is a ``ScheduleBuilder`` (see ``shape``), called as ``(ranks, microbatches,
virtual_stages=None, costs=None) -> Schedule``; ``virtual_stages`` is the number of stages per
rank (None: the builder's default) and ``costs`` only matters for cost-driven builders (zb-h2,
zb-auto), which also take their own memory option. The registered builder checks the sizes every
schedule shares, then hands a ``Shape`` to the schedule's program maker, which checks its own
requirements. Unsupported sizes raise a ValueError whose message starts with the offending
parameter's name.
"""
from __future__ import annotations

from typing import Optional

from ..ir import Schedule
from ..timeline import Costs
from .dualpipe import build_dualpipe, build_dualpipev
from .one_f_one_b import build_1f1b, build_combined_1f1b, build_interleaved_1f1b
from .shape import ScheduleBuilder
from .zb_auto import build_zb_auto
from .zb_interleaved import build_zb_interleaved
from .zbv import build_zbv
from .zero_bubble import build_zb_h1, build_zb_h2

BUILDERS: dict[str, ScheduleBuilder] = {
    builder.name: builder
    for builder in (
        build_1f1b,
        build_combined_1f1b,
        build_interleaved_1f1b,
        build_zb_h1,
        build_zb_h2,
        build_zb_auto,
        build_zb_interleaved,
        build_zbv,
        build_dualpipe,
        build_dualpipev,
    )
}

SCHEDULES = tuple(BUILDERS)


def build(
    name: str,
    ranks: int,
    microbatches: int,
    virtual_stages: Optional[int] = None,
    costs: Optional[Costs] = None,
    memory_limit: Optional[float] = None,
) -> Schedule:
    """Build the named schedule's compute-only programs; `memory_limit` (live activations per rank, in
    stage micro-batches) is zb-auto's search limit and applies to it only."""
    if name not in BUILDERS:
        raise ValueError(f"schedule: unknown {name!r}, choose one of {', '.join(SCHEDULES)}")
    if memory_limit is not None:
        if name != "zb-auto":
            raise ValueError(f"schedule: memory_limit applies to zb-auto only, not {name!r}")
        return build_zb_auto(ranks, microbatches, virtual_stages, costs, memory_limit)
    return BUILDERS[name](ranks, microbatches, virtual_stages, costs)


__all__ = [
    "BUILDERS",
    "SCHEDULES",
    "build",
    "build_1f1b",
    "build_combined_1f1b",
    "build_interleaved_1f1b",
    "build_zb_h1",
    "build_zb_h2",
    "build_zb_auto",
    "build_zb_interleaved",
    "build_zbv",
    "build_dualpipe",
    "build_dualpipev",
]
