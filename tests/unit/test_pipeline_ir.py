"""Schedule IR: action invariants, FB halves, placements and micro-batch directions."""
import pytest

from parallel.pipeline.ir import (
    Action,
    ActionKind,
    CommBatch,
    LoweredSchedule,
    Placement,
    Schedule,
    fb,
)

F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW


def test_fb_exposes_both_halves():
    pair = fb(Action(F, 0, 3), Action(BW, 1, 1))
    assert pair.kind is ActionKind.FB
    assert (pair.stage, pair.microbatch) == (0, 3)
    assert (pair.b_kind, pair.b_stage, pair.b_microbatch) == (BW, 1, 1)
    assert pair.halves() == (Action(F, 0, 3), Action(BW, 1, 1))
    assert Action(W, 2, 0).halves() == (Action(W, 2, 0),)


@pytest.mark.parametrize(
    "make",
    [
        lambda: fb(Action(F, 0, 1), Action(BW, 1, 1)),
        lambda: fb(Action(F, 0, 1), Action(W, 1, 0)),
        lambda: fb(Action(B, 0, 1), Action(BW, 1, 0)),
        lambda: Action(ActionKind.FB, 0, 1),
        lambda: Action(F, 0, 1, b_kind=B, b_stage=0, b_microbatch=0),
        lambda: Action(ActionKind.SEND_F, 0, 1),
        lambda: Action(F, 0, 1, peer=1),
    ],
)
def test_malformed_actions_are_rejected(make):
    with pytest.raises(ValueError):
        make()


def test_text_form_names_kind_stage_microbatch_and_peer():
    assert str(Action(ActionKind.SEND_B, 2, 5, peer=1)) == "SEND_B2.5>1"
    assert str(Action(ActionKind.RECV_F, 3, 0, peer=2)) == "RECV_F3.0<2"
    assert str(fb(Action(F, 0, 4), Action(B, 1, 2))) == "FB[F0.4+B1.2]"


def test_loop_placement_plain_and_interleaved():
    plain = Placement("loop", 4, 4)
    assert [plain.rank_of(s) for s in range(4)] == [0, 1, 2, 3]
    interleaved = Placement("loop", 3, 6)
    assert [interleaved.rank_of(s) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert interleaved.stages_on(1) == (1, 4)


def test_v_placement_puts_both_model_ends_on_rank_0():
    v = Placement("v", 3, 6)
    assert [v.rank_of(s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert all(v.stages_on(r) == (r, 5 - r) for r in range(3))


def test_mirror_placement_reverses_direction_1():
    mirror = Placement("mirror", 4, 4)
    assert [mirror.rank_of(s, 0) for s in range(4)] == [0, 1, 2, 3]
    assert [mirror.rank_of(s, 1) for s in range(4)] == [3, 2, 1, 0]
    assert mirror.stages_on(1) == (1, 2)


@pytest.mark.parametrize(
    "kind, ranks, stages", [("loop", 4, 6), ("v", 2, 3), ("mirror", 2, 4), ("ring", 2, 2)]
)
def test_inconsistent_placements_are_rejected(kind, ranks, stages):
    with pytest.raises(ValueError):
        Placement(kind, ranks, stages)


def test_mirror_schedule_splits_microbatches_into_two_directions():
    placement = Placement("mirror", 2, 2)
    schedule = Schedule("t", placement, 4, ((), ()))
    assert [schedule.direction(m) for m in range(4)] == [0, 0, 1, 1]
    assert [schedule.rank_of(0, m) for m in range(4)] == [0, 0, 1, 1]


def test_builders_output_must_be_compute_only():
    with pytest.raises(ValueError, match="compute only"):
        Schedule("t", Placement("loop", 1, 1), 1, ((Action(ActionKind.SEND_F, 0, 0, peer=0),),))


def test_lowered_flat_expands_batches_in_order():
    send = Action(ActionKind.SEND_F, 0, 0, peer=1)
    recv = Action(ActionKind.RECV_B, 0, 0, peer=1)
    schedule = Schedule("t", Placement("loop", 2, 2), 1, ((Action(F, 0, 0),), ()))
    lowered = LoweredSchedule(schedule, ((Action(F, 0, 0), CommBatch((send, recv))), ()))
    assert lowered.flat(0) == (Action(F, 0, 0), send, recv)
