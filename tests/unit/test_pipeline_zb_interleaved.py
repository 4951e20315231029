"""zb-interleaved against torch's `ScheduleInterleavedZeroBubble`, action for action: torch builds its
`pipeline_order` in its constructor, here from stand-in stages that carry only what that needs (rank,
group size, stage index); its BACKWARD_INPUT is our B. Plus the requirements it refuses."""
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

from parallel.pipeline import ActionKind, Costs, build
from parallel.pipeline.timeline import simulate

TORCH_KIND = {"FORWARD": ActionKind.F, "BACKWARD_INPUT": ActionKind.B, "BACKWARD_WEIGHT": ActionKind.W}


def torch_order(ranks: int, chunks: int, microbatches: int) -> list[list[tuple]]:
    """Per rank, torch's (kind, stage, micro-batch) sequence, idle slots dropped."""
    stages = [SimpleNamespace(group_size=ranks, group_rank=0, stage_index=c * ranks, num_stages=ranks * chunks,
                              is_first=c == 0, is_last=False, has_backward=True, submod=None)
              for c in range(chunks)]
    schedule = ScheduleInterleavedZeroBubble(stages, microbatches, loss_fn=lambda output, target: output)
    return [[(TORCH_KIND[a.computation_type.name], a.stage_index, a.microbatch_index)
             for a in schedule.pipeline_order[rank] if a is not None] for rank in range(ranks)]


CASES = [(r, v, m) for r in (2, 3, 4, 8) for v in (2, 3) for m in (2, r, r + 1, 2 * r, 3 * r) if m % max(1, m // r) == 0]


@pytest.mark.parametrize("ranks, chunks, microbatches", CASES)
def test_zb_interleaved_is_torchs_interleaved_zero_bubble(ranks, chunks, microbatches):
    ours = build("zb-interleaved", ranks, microbatches, chunks)
    want = torch_order(ranks, chunks, microbatches)
    for rank, (program, expected) in enumerate(zip(ours.programs, want)):
        got = [(a.kind, a.stage, a.microbatch) for a in program]
        assert got == expected, f"rank {rank}: ours {got}\ntorch's {expected}"


def test_zb_interleaved_fills_the_interleaved_bubble_with_weight_gradients():
    """Same placement and order of forwards as interleaved 1F1B, shorter under split costs (W fills idle time)."""
    costs = Costs(f=1.0, b=1.0, w=1.0)
    zb = simulate(build("zb-interleaved", 4, 8, 2), costs)
    interleaved = simulate(build("interleaved-1f1b", 4, 8, 2), costs)
    assert zb.makespan < interleaved.makespan


@pytest.mark.parametrize("args, param", [((4, 8, 1), "virtual_stages"), ((4, 9, 2), "microbatches"),
                                         ((0, 4, 2), "ranks")])
def test_zb_interleaved_refuses_what_it_cannot_build(args, param):
    with pytest.raises(ValueError, match=f"^{param}:"):
        build("zb-interleaved", *args)
