"""Schedule IR: actions, stage placement, compute-only schedules and lowered schedules.

A schedule is one ordered action list per pipeline rank. ``stage`` is always the global
model-chunk index (0 = embedding side, ``num_stages - 1`` = head side); which rank runs a stage is
the placement's business, so builders, validators, the simulator and the runtime never hard-code a
layout.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union


class ScheduleError(ValueError):
    """A schedule breaks an invariant: ordering, send/recv matching or deadlock freedom."""


class ActionKind(enum.Enum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    FB = "FB"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_comm(self) -> bool:
        return self in _COMM_KINDS

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)


_COMM_KINDS = frozenset(
    {ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B}
)
BACKWARD_KINDS = frozenset({ActionKind.B, ActionKind.BW})


@dataclass(frozen=True)
class Action:
    """One step of a rank's program.

    Compute kinds (F, B, W, BW) name the stage and micro-batch they work on. FB runs the forward
    ``(stage, microbatch)`` together with the backward ``(b_stage, b_microbatch)`` of another
    micro-batch, whose kind ``b_kind`` is B (weight grad deferred) or BW (full backward).
    Communication kinds name the local stage whose output they send (SEND_*) or whose input they
    receive (RECV_*), and ``peer`` is the other rank.
    """

    kind: ActionKind
    stage: int
    microbatch: int
    peer: Optional[int] = None
    b_kind: Optional[ActionKind] = None
    b_stage: Optional[int] = None
    b_microbatch: Optional[int] = None

    def __post_init__(self) -> None:
        has_b = (self.b_kind, self.b_stage, self.b_microbatch) != (None, None, None)
        if self.kind is ActionKind.FB:
            if self.b_kind not in BACKWARD_KINDS or None in (self.b_stage, self.b_microbatch):
                raise ValueError(f"FB needs b_kind in (B, BW), b_stage and b_microbatch: {self!r}")
            if self.b_microbatch == self.microbatch:
                raise ValueError(f"FB halves must be different micro-batches: {self!r}")
        elif has_b:
            raise ValueError(f"only FB has a backward half: {self!r}")
        if self.kind.is_comm != (self.peer is not None):
            raise ValueError(f"peer is required for communication and only for it: {self!r}")

    @property
    def is_comm(self) -> bool:
        return self.kind.is_comm

    def halves(self) -> tuple[Action, ...]:
        """The plain compute actions this action runs: (F, backward) for FB, else itself."""
        if self.kind is not ActionKind.FB:
            return (self,)
        assert self.b_kind is not None
        assert self.b_stage is not None and self.b_microbatch is not None
        return (
            Action(ActionKind.F, self.stage, self.microbatch),
            Action(self.b_kind, self.b_stage, self.b_microbatch),
        )

    def __str__(self) -> str:
        if self.kind is ActionKind.FB:
            fwd, bwd = self.halves()
            return f"FB[{fwd}+{bwd}]"
        text = f"{self.kind.value}{self.stage}.{self.microbatch}"
        if self.peer is None:
            return text
        return f"{text}{'>' if self.kind.is_send else '<'}{self.peer}"


def fb(forward: Action, backward: Action) -> Action:
    """Fuse a forward and a backward (B or BW) of different micro-batches into one FB action."""
    if forward.kind is not ActionKind.F:
        raise ValueError(f"first half of FB must be F, got {forward}")
    return Action(
        ActionKind.FB,
        forward.stage,
        forward.microbatch,
        b_kind=backward.kind,
        b_stage=backward.stage,
        b_microbatch=backward.microbatch,
    )


PLACEMENTS = ("loop", "v", "mirror")


@dataclass(frozen=True)
class Placement:
    """Stage -> rank map.

    ``loop``: stage s on rank s % num_ranks (plain when num_stages == num_ranks, interleaved when
    it is a multiple). ``v``: 2 stages per rank, rank r holds stages r and 2R-1-r, so both model
    ends sit on rank 0. ``mirror`` (DualPipe): num_stages == num_ranks and every stage has two
    replicas, one per direction: direction 0 puts stage s on rank s, direction 1 on rank R-1-s.
    """

    kind: str
    num_ranks: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.kind not in PLACEMENTS:
            raise ValueError(f"placement kind must be one of {PLACEMENTS}, got {self.kind!r}")
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        expected = {
            "loop": self.num_stages % self.num_ranks == 0 and self.num_stages >= self.num_ranks,
            "v": self.num_stages == 2 * self.num_ranks,
            "mirror": self.num_stages == self.num_ranks,
        }[self.kind]
        if not expected:
            raise ValueError(
                f"{self.kind} placement cannot put {self.num_stages} stages "
                f"on {self.num_ranks} ranks"
            )

    @property
    def num_directions(self) -> int:
        return 2 if self.kind == "mirror" else 1

    def rank_of(self, stage: int, direction: int = 0) -> int:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} out of range [0, {self.num_stages})")
        if not 0 <= direction < self.num_directions:
            raise ValueError(f"direction {direction} out of range for {self.kind} placement")
        if self.kind == "loop":
            return stage % self.num_ranks
        if self.kind == "v":
            return stage if stage < self.num_ranks else 2 * self.num_ranks - 1 - stage
        return stage if direction == 0 else self.num_ranks - 1 - stage

    def stages_on(self, rank: int) -> tuple[int, ...]:
        """Distinct stages whose parameters live on ``rank`` (both mirror replicas included)."""
        return tuple(
            sorted(
                {
                    s
                    for s in range(self.num_stages)
                    for d in range(self.num_directions)
                    if self.rank_of(s, d) == rank
                }
            )
        )


@dataclass(frozen=True)
class Schedule:
    """Compute-only per-rank programs produced by a builder.

    With a mirror placement the first half of the micro-batches flows in direction 0 and the
    second half in direction 1.
    """

    name: str
    placement: Placement
    num_microbatches: int
    programs: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if len(self.programs) != self.placement.num_ranks:
            raise ValueError(
                f"{len(self.programs)} programs for {self.placement.num_ranks} ranks"
            )
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        for rank, program in enumerate(self.programs):
            for action in program:
                if action.is_comm:
                    raise ValueError(f"rank {rank}: builders emit compute only, got {action}")

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    def direction(self, microbatch: int) -> int:
        if self.placement.num_directions == 1:
            return 0
        return int(microbatch >= self.num_microbatches // 2)

    def rank_of(self, stage: int, microbatch: int) -> int:
        return self.placement.rank_of(stage, self.direction(microbatch))


@dataclass(frozen=True)
class CommBatch:
    """Communication actions posted together as one batched P2P call (batch_isend_irecv)."""

    ops: tuple[Action, ...]

    def __str__(self) -> str:
        return "{" + " ".join(str(op) for op in self.ops) + "}"


Step = Union[Action, CommBatch]


@dataclass(frozen=True)
class LoweredSchedule:
    """A schedule with its communication inserted: per rank, compute actions and comm batches."""

    schedule: Schedule
    programs: tuple[tuple[Step, ...], ...]

    def flat(self, rank: int) -> tuple[Action, ...]:
        """The rank's actions with batches flattened, in posting order."""
        out: list[Action] = []
        for step in self.programs[rank]:
            out.extend(step.ops if isinstance(step, CommBatch) else (step,))
        return tuple(out)
