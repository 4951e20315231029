"""ZB-V: the handcrafted zero-bubble schedule on the V placement (2 stages per rank)."""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional

from ..ir import Action
from ..timeline import Costs
from .common import backward, forward, require, weight
from .shape import Programs, ScheduleBuilder, Shape


def _zbv(shape: Shape, costs: Optional[Costs]) -> Programs:
    """Rank r holds chunk 0 = stage r and chunk 1 = stage 2R-1-r.

    Per rank: 2(R-r)-1 forwards of chunk 0; r pairs (F1, F0); R-r triples (F1, B1, W1); a steady
    loop of (F0 while any is left, B0, W0, F1, B1, W1) until every forward is done; r pairs
    (B0, B1) whose W's are deferred; R-r pairs (B0, W0); then the deferred W's of chunk 1 and of
    chunk 0. With equal costs every rank is busy from its first to its last action, at 1F1B's
    peak activation memory (2R chunks). Requirements: microbatches >= 2*ranks - 1,
    virtual_stages 2.
    """
    ranks, microbatches = shape.ranks, shape.microbatches
    require(
        microbatches >= 2 * ranks - 1,
        "microbatches",
        f"zbv needs microbatches >= 2*ranks-1 = {2 * ranks - 1}, got {microbatches}",
    )
    return tuple(_rank_program(ranks, microbatches, r) for r in range(ranks))


build_zbv = ScheduleBuilder("zbv", "v", _zbv, stages_per_rank=2)


def _rank_program(ranks: int, microbatches: int, rank: int) -> tuple[Action, ...]:
    stages = (rank, 2 * ranks - 1 - rank)
    next_f, next_b = [0, 0], [0, 0]
    pending: tuple[deque[int], deque[int]] = (deque(), deque())
    program: list[Action] = []

    def f(chunk: int) -> None:
        program.append(forward(stages[chunk], next_f[chunk]))
        next_f[chunk] += 1

    def b(chunk: int) -> None:
        program.append(backward(stages[chunk], next_b[chunk], split=True))
        pending[chunk].append(next_b[chunk])
        next_b[chunk] += 1

    def w(chunk: int) -> None:
        program.append(weight(stages[chunk], pending[chunk].popleft()))

    for _ in range(2 * (ranks - rank) - 1):
        f(0)
    for _ in range(rank):
        f(1)
        f(0)
    for _ in range(ranks - rank):
        _run(f, b, w, chunk=1)
    while next_f[1] < next_f[0] or next_f[0] < microbatches:
        if next_f[0] < microbatches:
            f(0)
        _run(b, w, chunk=0)
        _run(f, b, w, chunk=1)
    for _ in range(rank):
        b(0)
        b(1)
    for _ in range(ranks - rank):
        _run(b, w, chunk=0)
    while pending[1]:
        w(1)
    while pending[0]:
        w(0)
    return tuple(program)


def _run(*steps: Callable[[int], None], chunk: int) -> None:
    for step in steps:
        step(chunk)
