"""Discrete-event simulation of a compute schedule: start/end times, bubble, activation memory.

Each rank runs its program in order; an action starts when the rank is free and every token it
needs exists (plus ``comm`` when the token comes from another rank). An FB action finishes both
halves at its end. Sends are modelled as eager; rendezvous blocking is the NCCL checker's job.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .graph import Token, produces, requires, producer_rank
from .ir import Action, ActionKind, Schedule, ScheduleError


@dataclass(frozen=True)
class Costs:
    """Per-stage (one model chunk, one micro-batch) costs and memory model.

    ``fb`` is the time of one overlapped FB action (default: the sum of its halves, i.e. no
    overlap gain). Memory is counted in units of one stage's activations of one micro-batch: F
    allocates 1, B frees ``mem_b``, W frees ``1 - mem_b``, BW frees 1. The default ``mem_b = 0``
    counts a micro-batch until its weight gradient is done ("in flight").
    """

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    fb: Optional[float] = None
    comm: float = 0.0
    mem_b: float = 0.0

    def __post_init__(self) -> None:
        for name in ("f", "b", "w"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cost {name} must be > 0, got {getattr(self, name)}")
        if self.fb is not None and not self.fb > 0:
            raise ValueError(f"cost fb must be > 0, got {self.fb}")
        if not self.comm >= 0:
            raise ValueError(f"comm latency must be >= 0, got {self.comm}")
        if not 0 <= self.mem_b <= 1:
            raise ValueError(f"mem_b must be in [0, 1], got {self.mem_b}")

    def of(self, action: Action) -> float:
        kind = action.kind
        if kind is ActionKind.FB:
            if self.fb is not None:
                return self.fb
            return sum(self.of(half) for half in action.halves())
        if kind is ActionKind.F:
            return self.f
        if kind is ActionKind.B:
            return self.b
        if kind is ActionKind.W:
            return self.w
        if kind is ActionKind.BW:
            return self.b + self.w
        raise ValueError(f"no cost for communication action {action}")

    def memory(self, action: Action) -> tuple[float, float]:
        """(allocated at start, freed at end) by ``action``."""
        alloc = free = 0.0
        for half in action.halves():
            if half.kind is ActionKind.F:
                alloc += 1.0
            elif half.kind is ActionKind.B:
                free += self.mem_b
            elif half.kind is ActionKind.W:
                free += 1.0 - self.mem_b
            else:
                free += 1.0
        return alloc, free


@dataclass(frozen=True)
class Timeline:
    """Simulated start and end time of every action, indexed like ``schedule.programs``."""

    schedule: Schedule
    costs: Costs
    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]

    @property
    def makespan(self) -> float:
        ends = [e for rank in self.end for e in rank]
        starts = [s for rank in self.start for s in rank]
        return max(ends) - min(starts) if ends else 0.0

    @property
    def busy(self) -> tuple[float, ...]:
        return tuple(
            sum(self.costs.of(a) for a in program) for program in self.schedule.programs
        )

    @property
    def bubble(self) -> float:
        """Max over ranks of makespan - busy: the idle time of the least busy rank."""
        return max(self.makespan - b for b in self.busy)

    @property
    def span_bubble(self) -> tuple[float, ...]:
        """Per rank: idle time between its own first start and last end."""
        return tuple(
            (max(e) - min(s) - b) if e else 0.0
            for s, e, b in zip(self.start, self.end, self.busy)
        )

    @property
    def peak_activations(self) -> tuple[float, ...]:
        """Per rank, in one stage's activations of one micro-batch (see ``Costs.memory``)."""
        peaks = []
        for program in self.schedule.programs:
            live = peak = 0.0
            for action in program:
                alloc, free = self.costs.memory(action)
                live += alloc
                peak = max(peak, live)
                live -= free
            peaks.append(peak)
        return tuple(peaks)


def simulate(schedule: Schedule, costs: Optional[Costs] = None) -> Timeline:
    """Run the discrete-event simulation; raise ScheduleError if the schedule gets stuck."""
    costs = costs or Costs()
    programs = schedule.programs
    ready_at: dict[Token, tuple[float, int]] = {}
    start: list[list[float]] = [[] for _ in programs]
    end: list[list[float]] = [[] for _ in programs]
    free = [0.0] * len(programs)
    pc = [0] * len(programs)
    progressed = True
    while progressed:
        progressed = False
        for rank, program in enumerate(programs):
            while pc[rank] < len(program):
                action = program[pc[rank]]
                t = _earliest_start(schedule, costs, rank, action, ready_at, free[rank])
                if t is None:
                    break
                done = t + costs.of(action)
                for token in produces(action):
                    if token in ready_at:
                        raise ScheduleError(f"rank {rank}: {action} produces {token} again")
                    ready_at[token] = (done, rank)
                start[rank].append(t)
                end[rank].append(done)
                free[rank] = done
                pc[rank] += 1
                progressed = True
    if any(pc[r] < len(p) for r, p in enumerate(programs)):
        raise ScheduleError(_stuck_report(schedule, pc, ready_at))
    return Timeline(
        schedule, costs, tuple(map(tuple, start)), tuple(map(tuple, end))
    )


def _earliest_start(
    schedule: Schedule,
    costs: Costs,
    rank: int,
    action: Action,
    ready_at: dict[Token, tuple[float, int]],
    rank_free: float,
) -> Optional[float]:
    t = rank_free
    for token in requires(action, schedule.num_stages):
        if token not in ready_at:
            return None
        done, src = ready_at[token]
        t = max(t, done + (costs.comm if src != rank else 0.0))
    return t


def _stuck_report(schedule: Schedule, pc: list[int], ready_at: dict) -> str:
    lines = ["schedule is stuck (dependency deadlock):"]
    for rank, program in enumerate(schedule.programs):
        if pc[rank] >= len(program):
            continue
        action = program[pc[rank]]
        missing = [
            f"{t} (from rank {producer_rank(schedule, t)})"
            for t in requires(action, schedule.num_stages)
            if t not in ready_at
        ]
        lines.append(f"  rank {rank} waits at {action} for {', '.join(missing)}")
    return "\n".join(lines)
