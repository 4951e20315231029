"""DualPipe (bidirectional, mirrored stages) and DualPipeV (V placement): the 8-phase programs.

Each rank has two phases. Phase 0 is the stage the rank reaches early (depth h from the entry of
its micro-batches), phase 1 the stage it reaches late. With h the rank's depth and H the number
of depths, every rank runs:

1. 2(H-h-1) F0                        5. H-h-1 x (BW1, FB(F1, BW0))
2. h+1 x (F0, F1)                     6. h+1 x (B1, B0), deferring W from the middle pair on
3. H-h-1 x (B1, W, F1)                7. H-h-1 x (W, B0)
4. n-2H+h+1 x (FB(F0, BW1), FB(F1, BW0)), the very first pair unfused on the deepest rank
                                      8. h+1 x W
where n is the number of micro-batches per phase. Overlapped pairs run full backwards; the split
ones (3, 6, 7) defer their W to a single FIFO.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

from ..ir import Action, fb
from ..timeline import Costs
from .common import backward, forward, require, weight
from .shape import Programs, ScheduleBuilder, Shape


def _dualpipe(shape: Shape, costs: Optional[Costs]) -> Programs:
    """DualPipe over R = PP ranks and PP stages; micro-batches 0..N/2-1 enter at rank 0 and flow
    to rank PP-1 (direction 0), N/2..N-1 enter at rank PP-1 (direction 1, mirrored stages).

    Rank r and rank PP-1-r run the same program with the directions swapped. Requirements: ranks
    even, microbatches even and >= 2*ranks, virtual_stages 1.
    """
    ranks, microbatches = shape.ranks, shape.microbatches
    require(ranks % 2 == 0, "ranks", f"dualpipe needs an even number of ranks, got {ranks}")
    require(
        microbatches % 2 == 0 and microbatches >= 2 * ranks,
        "microbatches",
        f"dualpipe needs an even number >= 2*ranks = {2 * ranks}, got {microbatches}",
    )
    half = ranks // 2
    per_direction = microbatches // 2
    programs = []
    for rank in range(ranks):
        second_half = rank >= half
        directions = (int(second_half), int(not second_half))
        stages = tuple(rank if d == 0 else ranks - 1 - rank for d in directions)
        offsets = tuple(d * per_direction for d in directions)
        depth = min(rank, ranks - 1 - rank)
        programs.append(_eight_phases(depth, half, per_direction, stages, offsets))
    return tuple(programs)


def _dualpipev(shape: Shape, costs: Optional[Costs]) -> Programs:
    """DualPipeV: R ranks hold 2R stages in V order (rank r: stages r and 2R-1-r); every
    micro-batch enters and leaves at rank 0. Requirements: microbatches >= 2*ranks,
    virtual_stages 2.
    """
    ranks, microbatches = shape.ranks, shape.microbatches
    require(
        microbatches >= 2 * ranks,
        "microbatches",
        f"dualpipev needs microbatches >= 2*ranks = {2 * ranks}, got {microbatches}",
    )
    return tuple(
        _eight_phases(rank, ranks, microbatches, (rank, 2 * ranks - 1 - rank), (0, 0))
        for rank in range(ranks)
    )


build_dualpipe = ScheduleBuilder("dualpipe", "mirror", _dualpipe)
build_dualpipev = ScheduleBuilder("dualpipev", "v", _dualpipev, stages_per_rank=2)


def _eight_phases(
    depth: int,
    depths: int,
    per_phase: int,
    stages: tuple[int, ...],
    offsets: tuple[int, ...],
) -> tuple[Action, ...]:
    h, H = depth, depths
    next_f, next_b = [0, 0], [0, 0]
    deferred: deque[Action] = deque()
    program: list[Action] = []

    def f(phase: int) -> Action:
        action = forward(stages[phase], offsets[phase] + next_f[phase])
        next_f[phase] += 1
        return action

    def b(phase: int, split: bool) -> Action:
        action = backward(stages[phase], offsets[phase] + next_b[phase], split)
        next_b[phase] += 1
        if split:
            deferred.append(action)
        return action

    def w() -> Action:
        done = deferred.popleft()
        return weight(done.stage, done.microbatch)

    program += [f(0) for _ in range(2 * (H - h - 1))]
    for _ in range(h + 1):
        program += [f(0), f(1)]
    for _ in range(H - h - 1):
        program += [b(1, split=True), w(), f(1)]
    for i in range(per_phase - 2 * H + h + 1):
        if i == 0 and h == H - 1:
            program += [f(0), b(1, split=False)]
        else:
            program.append(fb(f(0), b(1, split=False)))
        program.append(fb(f(1), b(0, split=False)))
    for _ in range(H - h - 1):
        program += [b(1, split=False), fb(f(1), b(0, split=False))]
    split = False
    for i in range(h + 1):
        if i == (h + 1) // 2 and h % 2 == 1:
            split = True
        program.append(b(1, split))
        if i == (h + 1) // 2 and h % 2 == 0:
            split = True
        program.append(b(0, split))
    for _ in range(H - h - 1):
        program += [w(), b(0, split=True)]
    program += [w() for _ in range(h + 1)]
    assert not deferred, "every deferred W must be popped by phase 8"
    return tuple(program)
