"""Lowering: insert SEND/RECV actions into a compute schedule and group them into batches.

Every cross-rank edge gets a time ``t``: when its producer finishes in the simulated timeline.
On any rank, the communication with time t goes into the gap just before the first compute
action that starts at or after t, so a SEND lands right after its producer and a RECV somewhere
before its consumer. All communication in one gap is one batch, ordered by (t, edge).

Why this cannot deadlock under rendezvous (NCCL) semantics: on every rank, batches hold
disjoint, increasing time intervals. Take the unfinished operation with the smallest t; every
batch before it on either of its two ranks only holds smaller times, hence is complete, so both
ranks have reached the batches holding the pair and the pair matches. Sorting by (t, edge) also
gives every sender/receiver channel the same order on both sides.
"""
from __future__ import annotations

import bisect
from typing import Optional

from .graph import Edge, cross_rank_inputs, produces, send_action, recv_action
from .ir import Action, CommBatch, LoweredSchedule, Schedule, Step
from .timeline import Costs, simulate


def lower(schedule: Schedule, costs: Optional[Costs] = None) -> LoweredSchedule:
    """Insert and batch the communication of ``schedule``, timed with ``costs`` (default unit)."""
    timeline = simulate(schedule, costs)
    done_at = {
        token: timeline.end[rank][i]
        for rank, program in enumerate(schedule.programs)
        for i, action in enumerate(program)
        for token in produces(action)
    }
    gaps: list[dict[int, list[tuple[float, tuple, Action]]]] = [{} for _ in schedule.programs]

    def place(rank: int, t: float, edge: Edge, action: Action) -> None:
        gap = bisect.bisect_left(timeline.start[rank], t)
        gaps[rank].setdefault(gap, []).append((t, _edge_key(edge), action))

    for rank, program in enumerate(schedule.programs):
        for action in program:
            for edge in cross_rank_inputs(schedule, rank, action):
                t = done_at[edge.token]
                place(edge.src, t, edge, send_action(edge))
                place(edge.dst, t, edge, recv_action(edge))

    programs = []
    for rank, program in enumerate(schedule.programs):
        steps: list[Step] = []
        for gap in range(len(program) + 1):
            ops = sorted(gaps[rank].get(gap, ()), key=lambda item: item[:2])
            if ops:
                steps.append(CommBatch(tuple(op for _, _, op in ops)))
            if gap < len(program):
                steps.append(program[gap])
        programs.append(tuple(steps))
    return LoweredSchedule(schedule, tuple(programs))


def _edge_key(edge: Edge) -> tuple:
    return (edge.token.kind.value, edge.token.stage, edge.token.microbatch)
