"""Zero Bubble schedules on one stage per rank: handcrafted ZB-H1 and the memory-capped ZB-H2.

Both split every backward into B (input grad, what the upstream stage waits for) and a deferred
W (weight grad) that fills bubbles later on the same stage.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Optional, Sequence

from ..ir import Action, Schedule
from ..timeline import Costs, Timeline, simulate
from .common import backward, forward, require, weight
from .shape import Programs, ScheduleBuilder, Shape

_EPS = 1e-9


def _zb_h1(shape: Shape, costs: Optional[Costs]) -> Programs:
    """ZB-H1: 1F1B order with stage r's W's lagging r micro-batches behind its B's.

    Same warm-up and peak memory as 1F1B (stage r holds at most R micro-batches, the extra ones
    on later stages only pending their W). Requirements: ranks >= 1, microbatches >= 1,
    virtual_stages 1.
    """
    ranks, microbatches = shape.ranks, shape.microbatches
    programs = []
    for rank in range(ranks):
        warmup = min(ranks - 1 - rank, microbatches)
        program: list[Action] = [forward(rank, m) for m in range(warmup)]
        pending: deque[int] = deque()

        def split_backward(m: int) -> None:
            program.append(backward(rank, m, split=True))
            pending.append(m)
            while len(pending) > rank:
                program.append(weight(rank, pending.popleft()))

        for m in range(microbatches - warmup):
            program.append(forward(rank, warmup + m))
            split_backward(m)
        for m in range(microbatches - warmup, microbatches):
            split_backward(m)
        program += [weight(rank, m) for m in pending]
        programs.append(tuple(program))
    return tuple(programs)


def _zb_h2(shape: Shape, costs: Optional[Costs], max_inflight: Optional[int] = None) -> Programs:
    """ZB-H2 by list scheduling under a memory cap (default 2R-1 micro-batches in flight).

    Every rank, at its current time, runs the first of: a B whose gradient has arrived, an F
    whose input has arrived, that fits under the cap and that ends before the next B is expected
    plus a slack, a pending W when nothing else is due before it would finish; otherwise it waits
    for the next event. A greedy F can delay the next B, and through it every upstream stage;
    how long an F may overrun that expected arrival is cost-dependent, so a few slacks
    (``FORWARD_SLACKS``) are tried and the shortest simulated schedule is kept. With equal costs
    and M >= 2R-1 every rank is busy from its first F to its last W. Requirements: ranks >= 1,
    microbatches >= 1, virtual_stages 1, max_inflight >= 1.
    """
    cap = 2 * shape.ranks - 1 if max_inflight is None else max_inflight
    require(cap >= 1, "max_inflight", f"zb-h2 needs max_inflight >= 1, got {max_inflight}")
    costs = costs or Costs()
    return shortest(list_schedules(shape, costs, cap, freed_by_b=0.0), shape, costs)


build_zb_h1 = ScheduleBuilder("zb-h1", "loop", _zb_h1)
build_zb_h2 = ScheduleBuilder("zb-h2", "loop", _zb_h2)


FORWARD_SLACKS: tuple[float, ...] = (math.inf, 0.0, 0.5, 1.0)
"""How far (in units of F's cost) an F may end after the next B's expected arrival; inf is the
greedy rule (any F that fits runs while the B is not there)."""


def list_schedules(shape: Shape, costs: Costs, limit: float, freed_by_b: float) -> list[Programs]:
    """One program set per forward slack, each rank's activations under ``limit`` (F allocates
    1, B frees ``freed_by_b``, W the rest; ZB-H2 counts a micro-batch until its W, i.e. 0)."""
    return [
        _ListScheduler(shape.ranks, shape.microbatches, costs, limit, freed_by_b, slack * costs.f).run()
        for slack in FORWARD_SLACKS
    ]


def loop_timeline(programs: Programs, shape: Shape, costs: Costs) -> Timeline:
    """The simulated run of one stage per rank's ``programs`` (the zero-bubble candidates)."""
    return simulate(Schedule("candidate", shape.placement("loop"), shape.microbatches, programs), costs)


def shortest(candidates: Sequence[Programs], shape: Shape, costs: Costs) -> Programs:
    """The candidate with the least simulated makespan, then the least idle inside rank spans;
    ties keep the earlier candidate."""

    def score(programs: Programs) -> tuple[float, float]:
        timeline = loop_timeline(programs, shape, costs)
        return round(timeline.makespan, 9), round(sum(timeline.span_bubble), 9)

    return min(candidates, key=score)


class _ListScheduler:
    """Greedy time-driven scheduler behind ZB-H2 (loop placement, one stage per rank)."""

    def __init__(
        self,
        ranks: int,
        microbatches: int,
        costs: Costs,
        limit: float,
        freed_by_b: float,
        forward_slack: float,
    ) -> None:
        self.ranks, self.microbatches, self.costs = ranks, microbatches, costs
        self.limit, self.freed_by_b, self.forward_slack = limit, freed_by_b, forward_slack
        self.clock = [0.0] * ranks
        self.next_f = [0] * ranks
        self.next_b = [0] * ranks
        self.pending: list[deque[int]] = [deque() for _ in range(ranks)]
        self.f_done: list[list[float]] = [[] for _ in range(ranks)]
        self.b_done: list[list[float]] = [[] for _ in range(ranks)]
        self.programs: list[list[Action]] = [[] for _ in range(ranks)]

    def run(self) -> tuple[tuple[Action, ...], ...]:
        while not all(self._finished(r) for r in range(self.ranks)):
            order = sorted(
                (r for r in range(self.ranks) if not self._finished(r)),
                key=lambda r: (self.clock[r], r),
            )
            if not any(self._step(r) for r in order):
                raise RuntimeError("zb-h2 list scheduler made no progress")
        return tuple(tuple(p) for p in self.programs)

    def _finished(self, r: int) -> bool:
        return self.next_b[r] == self.microbatches and not self.pending[r]

    def _live(self, r: int) -> float:
        """Activations held by rank r (see ``list_schedules``)."""
        weights_done = self.next_b[r] - len(self.pending[r])
        return (
            self.next_f[r]
            - self.next_b[r] * self.freed_by_b
            - weights_done * (1.0 - self.freed_by_b)
        )

    def _b_ready(self, r: int) -> tuple[float, float]:
        """(known ready time or inf, lower bound) of rank r's next B."""
        m = self.next_b[r]
        if m >= self.next_f[r]:
            return math.inf, math.inf
        if r == self.ranks - 1:
            return self.f_done[r][m], self.f_done[r][m]
        if m < len(self.b_done[r + 1]):
            t = self.b_done[r + 1][m] + self.costs.comm
            return t, t
        return math.inf, self.clock[r + 1] + self.costs.b + self.costs.comm

    def _f_ready(self, r: int) -> tuple[float, float]:
        m = self.next_f[r]
        if m >= self.microbatches or self._live(r) + 1.0 > self.limit + _EPS:
            return math.inf, math.inf
        if r == 0:
            return 0.0, 0.0
        if m < len(self.f_done[r - 1]):
            t = self.f_done[r - 1][m] + self.costs.comm
            return t, t
        return math.inf, self.clock[r - 1] + self.costs.f + self.costs.comm

    def _expected_b(self, r: int) -> float:
        """When rank r's next B gradient should arrive if every later stage runs it first."""
        m = self.next_b[r]
        if m >= self.next_f[r]:
            return math.inf
        if r == self.ranks - 1:
            return self.f_done[r][m]
        if m < len(self.b_done[r + 1]):
            return self.b_done[r + 1][m] + self.costs.comm
        below = r + 1
        if below == self.ranks - 1:
            arrival = self._expected_f_done(below, m)
        else:
            arrival = self._expected_b(below)
        return max(self.clock[below], arrival) + self.costs.b + self.costs.comm

    def _expected_f_done(self, r: int, m: int) -> float:
        """When F(r, m) should end if every stage runs its forwards back to back."""
        if m < len(self.f_done[r]):
            return self.f_done[r][m]
        arrival = 0.0 if r == 0 else self._expected_f_done(r - 1, m) + self.costs.comm
        queued = m - self.next_f[r] + 1
        return max(self.clock[r], arrival) + queued * self.costs.f

    def _step(self, r: int) -> bool:
        now = self.clock[r]
        b_at, b_bound = self._b_ready(r)
        f_at, f_bound = self._f_ready(r)
        if b_at <= now + _EPS:
            self._run_backward(r)
            return True
        b_due = b_bound if math.isinf(self.forward_slack) else self._expected_b(r)
        f_held = now + self.costs.f > b_due + self.forward_slack + _EPS
        if f_at <= now + _EPS and not f_held:
            self._run_forward(r)
            return True
        f_due = math.inf if f_held else f_bound
        if self.pending[r] and min(b_due, f_due) >= now + self.costs.w - _EPS:
            self._run(r, weight(r, self.pending[r].popleft()), self.costs.w)
            return True
        later = [t for t in (b_at, f_at, b_bound, f_bound, b_due) if now + _EPS < t < math.inf]
        if later:
            self.clock[r] = min(later)
            return True
        if f_at <= now + _EPS:  # held back for a B that nothing can deliver before it
            self._run_forward(r)
            return True
        return False

    def _run_forward(self, r: int) -> None:
        self._run(r, forward(r, self.next_f[r]), self.costs.f)
        self.f_done[r].append(self.clock[r])
        self.next_f[r] += 1

    def _run_backward(self, r: int) -> None:
        self._run(r, backward(r, self.next_b[r], split=True), self.costs.b)
        self.b_done[r].append(self.clock[r])
        self.pending[r].append(self.next_b[r])
        self.next_b[r] += 1

    def _run(self, r: int, action: Action, cost: float) -> None:
        self.programs[r].append(action)
        self.clock[r] += cost
