"""Pipeline parallelism: schedule IR, builders, lowering, validators, simulator, runtime.

The runtime gets its per-rank programs from ``validate(build(name, ranks, microbatches), costs)``: a
schedule's compute-only programs, checked by every validator and lowered with its communication
(``costs``, default unit costs, shape both cost-driven builders and where communication is placed;
any positive costs give a deadlock-free lowering). The simulator
is ``parallel.pipeline.timeline.simulate`` and its command line ``python -m
parallel.pipeline.simulate``.
"""
from .builders import SCHEDULES, build
from .ir import (
    Action,
    ActionKind,
    CommBatch,
    LoweredSchedule,
    Placement,
    Schedule,
    ScheduleError,
    Step,
)
from .lowering import lower
from .timeline import Costs, Timeline
from .validate import validate

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "CommBatch",
    "Costs",
    "LoweredSchedule",
    "Placement",
    "Schedule",
    "ScheduleError",
    "Step",
    "Timeline",
    "build",
    "lower",
    "validate",
]
