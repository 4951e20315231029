"""The pipeline schedule a config asks for, read from the config in one place, and the stage cut."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moe_train.batch_ramp import batch_ramp
from moe_train.config import Config, ConfigError, zb_search
from moe_train.zb_measure import WARMUP_SCHEDULE, measures_zb_costs
from parallel.pipeline.builders import build
from parallel.pipeline.ir import LoweredSchedule, Schedule
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


def choose_schedule(config: Config, dp: int, measured: Costs | None = None, warm_up: bool = True,
                    global_batch: int | None = None) -> ScheduleChoice:
    """The schedule for a step's micro-batches (`global_batch`, default train.global_batch_size, over
    micro batch x dp). zb-auto without parallel.zb_costs starts as the warm-up schedule until `measured`
    costs are given; `warm_up` False: the search with the builder's default costs instead (what the planner
    shows)."""
    p, t = config.parallel, config.train
    name, (costs, memory_limit) = p.schedule, zb_search(p)
    if measures_zb_costs(p) and warm_up:
        name, costs, memory_limit = (WARMUP_SCHEDULE, None, None) if measured is None else (p.schedule, measured,
                                                                                            memory_limit)
    batch = t.global_batch_size if global_batch is None else global_batch
    return ScheduleChoice(name, p.pp, batch // (t.micro_batch_size * dp),
                          p.virtual_stages if p.virtual_stages > 1 else None, costs, memory_limit)


def plan_pipeline(config: Config, dp: int, measured: Costs | None = None,
                  global_batch: int | None = None) -> tuple[LoweredSchedule, list[StageSpec]]:
    """The lowered schedule (choose_schedule) of a step of `global_batch` samples (default the final batch)
    and the stage cut the trainer runs, or a ConfigError."""
    p, choice = config.parallel, choose_schedule(config, dp, measured, global_batch=global_batch)
    try:
        return pipeline_plan(config.model, choice.pp, choice.name, choice.microbatches, choice.virtual_stages,
                             p.pipeline_layout, p.first_stage_layers, p.last_stage_layers, choice.costs,
                             choice.memory_limit)
    except ValueError as err:
        if global_batch is not None and global_batch != config.train.global_batch_size:
            raise ConfigError([ramp_schedule_problem(config, dp, choice, global_batch, err)]) from None
        raise ConfigError([("parallel", f"schedule {choice.name} on pp={p.pp} with {choice.microbatches} "
                                        f"micro-batches per step: {err}")]) from None


def ramp_schedule_problem(config: Config, dp: int, choice: ScheduleChoice, global_batch: int,
                          err: ValueError) -> tuple[str, str]:
    """The problem of a step of the batch ramp whose micro-batch count the schedule cannot run."""
    return ("train.rampup_batch_size", f"a step of {global_batch} samples is {choice.microbatches} micro-batches "
                                       f"per pipeline (train.micro_batch_size={config.train.micro_batch_size} x "
                                       f"dp={dp}), which schedule {choice.name} on pp={choice.pp} cannot run: {err}")


def ramp_schedules(config: Config, dp: int, warm_up: bool = True) -> list[Schedule]:
    """The schedules of the batch ramp's steps below the final batch (train.rampup_batch_size; see
    choose_schedule for `warm_up`), built, or a ConfigError naming the key for the first micro-batch count
    the schedule cannot run. Building checks a count cheaply; the trainer lowers each when a step first
    uses it."""
    schedules = []
    for size in batch_ramp(config.train).sizes()[:-1]:
        choice = choose_schedule(config, dp, warm_up=warm_up, global_batch=size)
        try:
            schedules.append(build(choice.name, choice.pp, choice.microbatches, choice.virtual_stages,
                                   choice.costs, choice.memory_limit))
        except ValueError as err:
            raise ConfigError([ramp_schedule_problem(config, dp, choice, size, err)]) from None
    return schedules


def check_pipeline(config: Config, dp: int) -> None:
    """What the trainer would refuse of its pipeline on dp replicas, as a ConfigError: the final batch's
    schedule and stage cut (zb-auto measuring its costs: also the schedule it switches to), and every
    micro-batch count of the batch ramp."""
    plan_pipeline(config, dp)
    if measures_zb_costs(config.parallel):  # what the warm-up switches to must fit as well
        plan_pipeline(config, dp, Costs())
    for warm_up in (True, False) if measures_zb_costs(config.parallel) else (True,):
        ramp_schedules(config, dp, warm_up)
