"""The pipeline schedule a config asks for, read from the config in one place, and the stage cut."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moe_train.config import Config, ConfigError, zb_search
from moe_train.zb_measure import WARMUP_SCHEDULE, measures_zb_costs
from parallel.pipeline.ir import LoweredSchedule
from parallel.pipeline.model_pipeline import pipeline_plan
from parallel.pipeline.stage import StageSpec
from parallel.pipeline.timeline import Costs


@dataclass(frozen=True)
class ScheduleChoice:
    """The arguments of the schedule's builder: name, ranks, micro-batches per step, zb-auto's search."""
    name: str
    pp: int
    microbatches: int
    virtual_stages: Optional[int]
    costs: Optional[Costs]
    memory_limit: Optional[float]


def choose_schedule(config: Config, dp: int, measured: Costs | None = None, warm_up: bool = True) -> ScheduleChoice:
    """The schedule for a step's micro-batches (global batch / (micro batch x dp)). zb-auto without
    parallel.zb_costs starts as the warm-up schedule until `measured` costs are given; `warm_up` False:
    the search with the builder's default costs instead (what the planner shows)."""
    p, t = config.parallel, config.train
    name, (costs, memory_limit) = p.schedule, zb_search(p)
    if measures_zb_costs(p) and warm_up:
        name, costs, memory_limit = (WARMUP_SCHEDULE, None, None) if measured is None else (p.schedule, measured,
                                                                                            memory_limit)
    return ScheduleChoice(name, p.pp, t.global_batch_size // (t.micro_batch_size * dp),
                          p.virtual_stages if p.virtual_stages > 1 else None, costs, memory_limit)


def plan_pipeline(config: Config, dp: int, measured: Costs | None = None) -> tuple[LoweredSchedule, list[StageSpec]]:
    """The lowered schedule (choose_schedule) and the stage cut the trainer runs, or a ConfigError."""
    p, choice = config.parallel, choose_schedule(config, dp, measured)
    try:
        return pipeline_plan(config.model, choice.pp, choice.name, choice.microbatches, choice.virtual_stages,
                             p.pipeline_layout, p.first_stage_layers, p.last_stage_layers, choice.costs,
                             choice.memory_limit)
    except ValueError as err:
        raise ConfigError([("parallel", f"schedule {choice.name} on pp={p.pp} with {choice.microbatches} "
                                        f"micro-batches per step: {err}")]) from None
