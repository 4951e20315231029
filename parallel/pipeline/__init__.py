"""Pipeline parallelism: schedule IR, builders, lowering, validators, simulator, runtime.

The runtime gets its per-rank programs from ``plan(name, ranks, microbatches)``; the simulator
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
from .plan import plan
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
    "plan",
    "validate",
]
