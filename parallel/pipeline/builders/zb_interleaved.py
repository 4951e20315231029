"""Interleaved zero bubble (ZB1P with V stages per rank), the schedule of torch's
`ScheduleInterleavedZeroBubble`: interleaved 1F1B whose backwards are split into B and W, with each W
deferred by the rank's index so that it fills what would be the rank's bubble."""
from __future__ import annotations

from typing import Optional

from ..ir import Action
from ..timeline import Costs
from .common import backward, forward, require, weight
from .shape import Programs, ScheduleBuilder, Shape


def _zb_interleaved(shape: Shape, costs: Optional[Costs]) -> Programs:
    """V stages per rank in loop order (stage c*R + r on rank r); micro-batches run in rounds of
    R' = M / max(1, M // R) per chunk.

    Rank r runs (V-1)R' + R-1-r warm-up forwards (forward k is chunk (k // R') % V), then pairs each
    forward with a B (backward k is chunk V-1-((k - warm-up) // R') % V); once r such pairs ran, each
    B is followed by the W of the oldest B without one, and the Ws left over close the program.
    Requirements: virtual_stages >= 2 (default 2), microbatches >= 1 and a multiple of max(1, M // R).
    """
    ranks, microbatches, chunks = shape.ranks, shape.microbatches, shape.stages_per_rank
    rounds = max(1, microbatches // ranks)
    require(microbatches % rounds == 0, "microbatches",
            f"zb-interleaved needs a multiple of its {rounds} rounds (max(1, M // R)), got {microbatches}")
    per_round = microbatches // rounds
    total = microbatches * chunks
    programs = []
    for rank in range(ranks):
        warmup = min((chunks - 1) * per_round + ranks - 1 - rank, total)

        def forward_stage(k: int) -> int:
            return (k // per_round) % chunks * ranks + rank

        def backward_stage(k: int) -> int:
            return (chunks - 1 - (k - warmup) // per_round % chunks) * ranks + rank

        next_microbatch: dict[tuple[str, int], int] = {}

        def action(kind: str, stage: int) -> Action:
            m = next_microbatch.get((kind, stage), 0)
            next_microbatch[(kind, stage)] = m + 1
            if kind == "B":
                return backward(stage, m, split=True)
            return forward(stage, m) if kind == "F" else weight(stage, m)

        program: list[Action] = []
        backwards: list[int] = []  # the step k of every B so far; their Ws follow in that order
        weights_done = 0
        for k in range(total + warmup):
            if k < total:
                program.append(action("F", forward_stage(k)))
            if k < warmup:
                continue
            program.append(action("B", backward_stage(k)))
            backwards.append(k)
            if k - warmup >= rank:
                program.append(action("W", backward_stage(backwards[weights_done])))
                weights_done += 1
        program += [action("W", backward_stage(k)) for k in backwards[weights_done:]]
        programs.append(tuple(program))
    return tuple(programs)


build_zb_interleaved = ScheduleBuilder(
    "zb-interleaved", "loop", _zb_interleaved, stages_per_rank=2, single_stage_schedule="zb-h1"
)
