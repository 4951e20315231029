"""The call shape every schedule builder shares: the checked sizes (``Shape``) and the registered
builder (``ScheduleBuilder``) that checks them, runs the schedule's own program maker and names
and places the result."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..ir import Action, Placement, Schedule
from ..timeline import Costs
from .common import require

Programs = tuple[tuple[Action, ...], ...]


@dataclass(frozen=True)
class Shape:
    """A schedule's sizes once the common checks passed: ranks >= 1, microbatches >= 1, and
    ``stages_per_rank`` the builder's default wherever the caller gave none."""

    ranks: int
    microbatches: int
    stages_per_rank: int

    def placement(self, kind: str) -> Placement:
        return Placement(kind, self.ranks, self.ranks * self.stages_per_rank)


ProgramMaker = Callable[..., Programs]
"""``(shape, costs, *options) -> programs``, one per rank; options are the builder's own
(zb-h2's ``max_inflight``, zb-auto's ``memory_limit``)."""


@dataclass(frozen=True)
class ScheduleBuilder:
    """One schedule, callable as ``(ranks, microbatches, virtual_stages=None, costs=None)``.

    ``stages_per_rank`` is the only count of stages a rank may hold, unless
    ``single_stage_schedule`` names the schedule to use for one: then it is the default and any
    larger count is accepted too (the interleaved schedules). Requirements beyond these are the
    maker's, checked with ``require``.
    """

    name: str
    placement: str
    make: ProgramMaker
    stages_per_rank: int = 1
    single_stage_schedule: Optional[str] = None

    def __call__(
        self,
        ranks: int,
        microbatches: int,
        virtual_stages: Optional[int] = None,
        costs: Optional[Costs] = None,
        *options: Optional[float],
        **named_options: Optional[float],
    ) -> Schedule:
        shape = self.shape(ranks, microbatches, virtual_stages)
        programs = self.make(shape, costs, *options, **named_options)
        return Schedule(self.name, shape.placement(self.placement), microbatches, programs)

    def shape(self, ranks: int, microbatches: int, virtual_stages: Optional[int]) -> Shape:
        """The checks every builder shares; a violation names the parameter."""
        require(ranks >= 1, "ranks", f"{self.name} needs ranks >= 1, got {ranks}")
        require(
            microbatches >= 1,
            "microbatches",
            f"{self.name} needs microbatches >= 1, got {microbatches}",
        )
        stages = self.stages_per_rank if virtual_stages is None else virtual_stages
        if self.single_stage_schedule is None:
            require(
                stages == self.stages_per_rank,
                "virtual_stages",
                f"{self.name} places exactly {self.stages_per_rank} stage(s) per rank, got {virtual_stages}",
            )
        else:
            require(
                stages >= self.stages_per_rank,
                "virtual_stages",
                f"{self.name} needs virtual_stages >= {self.stages_per_rank} "
                f"(use {self.single_stage_schedule} for 1), got {virtual_stages}",
            )
        return Shape(ranks, microbatches, stages)
