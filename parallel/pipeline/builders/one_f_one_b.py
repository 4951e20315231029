"""1F1B, combined 1F1B (its steady-state pairs as FB actions) and interleaved 1F1B (Megatron
virtual pipeline stages), all with fused backward."""
from __future__ import annotations

from typing import Optional

from ..ir import Action, fb
from ..timeline import Costs
from .common import backward, forward, require
from .shape import Programs, ScheduleBuilder, Shape


def _one_f_one_b(shape: Shape, costs: Optional[Costs]) -> Programs:
    """One stage per rank; rank r runs min(R-1-r, M) warm-up forwards, then alternates F and BW.

    Requirements: ranks >= 1, microbatches >= 1, virtual_stages 1.
    """
    ranks, microbatches = shape.ranks, shape.microbatches
    programs = []
    for rank in range(ranks):
        warmup = min(ranks - 1 - rank, microbatches)
        program = [forward(rank, m) for m in range(warmup)]
        for m in range(microbatches - warmup):
            program += [forward(rank, warmup + m), backward(rank, m, split=False)]
        program += [
            backward(rank, m, split=False) for m in range(microbatches - warmup, microbatches)
        ]
        programs.append(tuple(program))
    return tuple(programs)


def _interleaved_1f1b(shape: Shape, costs: Optional[Costs]) -> Programs:
    """V stages per rank in loop order (stage c*R + r on rank r), micro-batches in groups of R.

    Rank r runs 2(R-1-r) + (V-1)R warm-up forwards, then 1F1B over its virtual forward and
    backward sequences: forwards walk chunk 0..V-1 for each group of R micro-batches, backwards
    walk chunk V-1..0. Requirements: virtual_stages >= 2 (default 2), microbatches a positive
    multiple of ranks.
    """
    ranks, microbatches, chunks = shape.ranks, shape.microbatches, shape.stages_per_rank
    require(
        microbatches % ranks == 0,
        "microbatches",
        f"interleaved-1f1b needs a positive multiple of ranks={ranks}, got {microbatches}",
    )
    total = microbatches * chunks

    def virtual(rank: int, k: int, is_forward: bool) -> Action:
        group, within = divmod(k, ranks * chunks)
        chunk = within // ranks
        if not is_forward:
            chunk = chunks - 1 - chunk
        stage = chunk * ranks + rank
        m = group * ranks + within % ranks
        return forward(stage, m) if is_forward else backward(stage, m, split=False)

    programs = []
    for rank in range(ranks):
        warmup = min(2 * (ranks - 1 - rank) + (chunks - 1) * ranks, total)
        program = [virtual(rank, k, True) for k in range(warmup)]
        for k in range(total - warmup):
            program += [virtual(rank, warmup + k, True), virtual(rank, k, False)]
        program += [virtual(rank, k, False) for k in range(total - warmup, total)]
        programs.append(tuple(program))
    return tuple(programs)


def _combined_1f1b(shape: Shape, costs: Optional[Costs]) -> Programs:
    """Megatron's "combined 1F1B": 1F1B whose steady state runs FB(F of m+2(R-1-r)+1, BW of m).

    An FB hands on its forward output only when both halves are done, so with 1F1B's warm-up
    (one forward more per rank upstream) rank r's FB m would wait for rank r+1's FB m, which
    waits for rank r's FB m-1: adjacent ranks would take turns. Rank r therefore warms up with
    2(R-1-r)+1 forwards (the last rank 1, so its forward pairs with an older backward): the
    upstream rank is always one FB ahead, and the steady state runs back to back. The price is
    2(R-r) micro-batches of activations in flight on rank r, 1F1B's R-r doubled.
    Requirements: as 1f1b.
    """
    ranks, microbatches = shape.ranks, shape.microbatches
    programs = []
    for rank in range(ranks):
        warmup = min(2 * (ranks - 1 - rank) + 1, microbatches)
        program = [forward(rank, m) for m in range(warmup)]
        program += [
            fb(forward(rank, warmup + m), backward(rank, m, split=False))
            for m in range(microbatches - warmup)
        ]
        program += [
            backward(rank, m, split=False) for m in range(microbatches - warmup, microbatches)
        ]
        programs.append(tuple(program))
    return tuple(programs)


build_1f1b = ScheduleBuilder("1f1b", "loop", _one_f_one_b)
build_interleaved_1f1b = ScheduleBuilder(
    "interleaved-1f1b", "loop", _interleaved_1f1b, stages_per_rank=2, single_stage_schedule="1f1b"
)
build_combined_1f1b = ScheduleBuilder("combined-1f1b", "loop", _combined_1f1b)
