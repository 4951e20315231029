"""Validators reject broken schedules; lowering stays deadlock-free under NCCL semantics."""
import dataclasses
import random

import pytest

from parallel.pipeline import SCHEDULES, Action, ActionKind, CommBatch, Costs, build, lower
from parallel.pipeline.ir import LoweredSchedule, Placement, Schedule, ScheduleError
from parallel.pipeline.validate import (
    check_comm,
    check_compute,
    check_dependencies,
    check_rendezvous,
    check_w_fifo,
)

F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW


def _with_program(schedule, rank, program):
    programs = list(schedule.programs)
    programs[rank] = tuple(program)
    return dataclasses.replace(schedule, programs=tuple(programs))


def _two_stage(programs, microbatches=2):
    return Schedule("test", Placement("loop", 2, 2), microbatches, tuple(map(tuple, programs)))


def test_missing_forward_is_rejected():
    schedule = build("1f1b", 2, 3)
    program = [a for a in schedule.programs[1] if a != Action(F, 1, 2)]
    with pytest.raises(ScheduleError, match="expected one F"):
        check_compute(_with_program(schedule, 1, program))


def test_action_on_a_rank_that_does_not_own_the_stage_is_rejected():
    schedule = build("1f1b", 2, 2)
    moved = _with_program(schedule, 0, schedule.programs[0] + (Action(F, 1, 0),))
    with pytest.raises(ScheduleError, match="lives on rank 1"):
        check_compute(moved)


def test_backward_must_be_one_bw_or_one_b_then_one_w():
    schedule = build("zb-h1", 2, 3)
    program = list(schedule.programs[0])
    b, w = program.index(Action(B, 0, 1)), program.index(Action(W, 0, 1))
    program[b], program[w] = program[w], program[b]
    with pytest.raises(ScheduleError, match="F < B < W"):
        check_compute(_with_program(schedule, 0, program))
    extra = _with_program(schedule, 0, schedule.programs[0] + (Action(BW, 0, 1),))
    with pytest.raises(ScheduleError, match="BW must be the only backward"):
        check_compute(extra)
    without_w = [a for a in schedule.programs[0] if a != Action(W, 0, 2)]
    with pytest.raises(ScheduleError, match="one B and one W"):
        check_compute(_with_program(schedule, 0, without_w))


def test_deferred_w_popped_out_of_fifo_order_is_rejected():
    schedule = build("zb-h1", 4, 8)
    program = list(schedule.programs[3])
    first, second = program.index(Action(W, 3, 6)), program.index(Action(W, 3, 7))
    program[first], program[second] = program[second], program[first]
    broken = _with_program(schedule, 3, program)
    check_compute(broken)
    with pytest.raises(ScheduleError, match="FIFO"):
        check_w_fifo(broken)


def test_dependency_cycle_is_reported_as_stuck():
    schedule = _two_stage(
        [
            [Action(F, 0, 0), Action(BW, 0, 0), Action(F, 0, 1), Action(BW, 0, 1)],
            [Action(F, 1, 1), Action(BW, 1, 1), Action(F, 1, 0), Action(BW, 1, 0)],
        ]
    )
    check_compute(schedule)
    with pytest.raises(ScheduleError, match="stuck"):
        check_dependencies(schedule)


def _replace_steps(lowered, rank, steps):
    programs = list(lowered.programs)
    programs[rank] = tuple(steps)
    return LoweredSchedule(lowered.schedule, tuple(programs))


def _drop_op(lowered, rank, op):
    steps = []
    for step in lowered.programs[rank]:
        if isinstance(step, CommBatch):
            ops = tuple(o for o in step.ops if o != op)
            if ops:
                steps.append(CommBatch(ops))
        else:
            steps.append(step)
    return _replace_steps(lowered, rank, steps)


def test_missing_receive_is_rejected():
    lowered = lower(build("1f1b", 3, 4))
    broken = _drop_op(lowered, 2, Action(ActionKind.RECV_F, 2, 1, peer=1))
    with pytest.raises(ScheduleError, match="mismatch"):
        check_comm(broken)


def test_receive_after_its_consumer_is_rejected():
    lowered = lower(build("1f1b", 2, 2))
    recv = Action(ActionKind.RECV_F, 1, 1, peer=0)
    steps = list(_drop_op(lowered, 1, recv).programs[1])
    steps.insert(steps.index(Action(F, 1, 1)) + 1, CommBatch((recv,)))
    with pytest.raises(ScheduleError, match="after its consumer"):
        check_comm(_replace_steps(lowered, 1, steps))


def test_send_before_its_producer_is_rejected():
    lowered = lower(build("1f1b", 2, 2))
    send = Action(ActionKind.SEND_F, 0, 1, peer=1)
    steps = list(_drop_op(lowered, 0, send).programs[0])
    steps.insert(steps.index(Action(F, 0, 1)), CommBatch((send,)))
    with pytest.raises(ScheduleError, match="before its producer"):
        check_comm(_replace_steps(lowered, 0, steps))


def test_communication_outside_a_batch_is_rejected():
    lowered = lower(build("1f1b", 2, 2))
    steps = []
    for step in lowered.programs[0]:
        steps.extend(step.ops if isinstance(step, CommBatch) else (step,))
    with pytest.raises(ScheduleError, match="outside a batch"):
        check_comm(_replace_steps(lowered, 0, steps))


def test_channel_order_must_agree_on_both_sides():
    lowered = lower(build("1f1b", 2, 4))
    sends = [Action(ActionKind.SEND_F, 0, m, peer=1) for m in (1, 0)]
    steps = [
        CommBatch(tuple(op for op in s.ops if op not in sends)) if isinstance(s, CommBatch) else s
        for s in lowered.programs[0]
    ]
    steps = [s for s in steps if not isinstance(s, CommBatch) or s.ops]
    steps.insert(steps.index(Action(F, 0, 1)) + 1, CommBatch(tuple(sends)))
    broken = _replace_steps(lowered, 0, steps)
    with pytest.raises(ScheduleError, match="different orders"):
        check_comm(broken)
    with pytest.raises(ScheduleError, match="NCCL would pair"):
        check_rendezvous(broken)


def _unbatched_sends_first(lowered):
    """Post every operation alone, sends before receives: the classic NCCL #479 hang."""
    programs = []
    for steps in lowered.programs:
        out = []
        for step in steps:
            if isinstance(step, CommBatch):
                ops = sorted(step.ops, key=lambda op: not op.kind.is_send)
                out += [CommBatch((op,)) for op in ops]
            else:
                out.append(step)
        programs.append(tuple(out))
    return LoweredSchedule(lowered.schedule, tuple(programs))


def _comm(kind, stage, microbatch, peer):
    return CommBatch((Action(kind, stage, microbatch, peer=peer),))


def test_minimal_unbatched_send_before_recv_cycle_deadlocks_but_batched_does_not():
    """Rank 0 sends F0.1 and needs the grad of mb 0; rank 1 sends that grad and needs F0.1."""
    schedule = _two_stage(
        [
            [Action(F, 0, 0), Action(F, 0, 1), Action(BW, 0, 0), Action(BW, 0, 1)],
            [Action(F, 1, 0), Action(BW, 1, 0), Action(F, 1, 1), Action(BW, 1, 1)],
        ]
    )
    send_f = Action(ActionKind.SEND_F, 0, 1, peer=1)
    recv_b = Action(ActionKind.RECV_B, 0, 0, peer=1)
    send_b = Action(ActionKind.SEND_B, 1, 0, peer=0)
    recv_f = Action(ActionKind.RECV_F, 1, 1, peer=0)

    def lowered(middle_0, middle_1):
        rank_0 = [
            Action(F, 0, 0), _comm(ActionKind.SEND_F, 0, 0, 1), Action(F, 0, 1), *middle_0,
            Action(BW, 0, 0), _comm(ActionKind.RECV_B, 0, 1, 1), Action(BW, 0, 1),
        ]
        rank_1 = [
            _comm(ActionKind.RECV_F, 1, 0, 0), Action(F, 1, 0), Action(BW, 1, 0), *middle_1,
            Action(F, 1, 1), Action(BW, 1, 1), _comm(ActionKind.SEND_B, 1, 1, 0),
        ]
        return LoweredSchedule(schedule, (tuple(rank_0), tuple(rank_1)))

    batched = lowered([CommBatch((send_f, recv_b))], [CommBatch((send_b, recv_f))])
    unbatched = lowered(
        [CommBatch((send_f,)), CommBatch((recv_b,))], [CommBatch((send_b,)), CommBatch((recv_f,))]
    )
    check_comm(batched)
    check_rendezvous(batched)
    check_comm(unbatched)
    with pytest.raises(ScheduleError, match="P2P deadlock"):
        check_rendezvous(unbatched)


@pytest.mark.parametrize(
    "name, ranks, microbatches",
    [("1f1b", 2, 3), ("zb-h1", 4, 8), ("zbv", 2, 4), ("dualpipe", 4, 8)],
)
def test_shipped_lowering_accepted_but_its_unbatched_form_deadlocks(name, ranks, microbatches):
    lowered = lower(build(name, ranks, microbatches))
    check_rendezvous(lowered)
    unbatched = _unbatched_sends_first(lowered)
    check_comm(unbatched)
    with pytest.raises(ScheduleError, match="P2P deadlock"):
        check_rendezvous(unbatched)


@pytest.mark.parametrize("name", SCHEDULES)
def test_lowering_is_deadlock_free_for_random_costs(name):
    rng = random.Random(sum(map(ord, name)))
    sizes = {"dualpipe": (4, 10), "interleaved-1f1b": (3, 6), "zb-interleaved": (3, 6)}.get(name, (3, 7))
    for _ in range(5):
        costs = Costs(
            f=rng.uniform(0.2, 2.0), b=rng.uniform(0.2, 2.0), w=rng.uniform(0.2, 2.0),
            fb=rng.choice([None, rng.uniform(0.5, 4.0)]),
            comm=rng.choice([0.0, rng.uniform(0.0, 1.0)]),
        )
        lowered = lower(build(name, *sizes, costs=costs), costs)
        check_comm(lowered)
        check_rendezvous(lowered)
