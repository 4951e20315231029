"""Validators for compute schedules and lowered schedules; each raises ScheduleError.

- ``check_compute``: one F per (stage, micro-batch) and either one BW or one B then one W, all on
  the owning rank, in the order F < B < W.
- ``check_w_fifo``: deferred W's of a stage are popped in the order their B's ran.
- ``check_dependencies``: the dependency simulation never gets stuck.
- ``check_comm``: every cross-rank edge has exactly one SEND after its producer and one RECV
  before its consumer, communication only inside batches, and every sender -> receiver channel
  carries its messages in the same order on both sides.
- ``check_rendezvous``: NCCL semantics, see its docstring.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Optional

from .graph import Edge, cross_rank_inputs, cross_rank_outputs, edge_of, recv_action, send_action
from .ir import Action, ActionKind, CommBatch, LoweredSchedule, Schedule, ScheduleError
from .lowering import lower
from .timeline import Costs, simulate


def check_compute(schedule: Schedule) -> None:
    positions: dict[tuple[ActionKind, int, int], list[tuple[int, int]]] = defaultdict(list)
    for rank, program in enumerate(schedule.programs):
        for i, action in enumerate(program):
            for half in action.halves():
                s, m = half.stage, half.microbatch
                if not (0 <= s < schedule.num_stages and 0 <= m < schedule.num_microbatches):
                    raise ScheduleError(f"rank {rank}: {action} is out of range")
                owner = schedule.rank_of(s, m)
                if owner != rank:
                    raise ScheduleError(
                        f"rank {rank} runs {half} but stage {s} of micro-batch {m} "
                        f"lives on rank {owner}"
                    )
                positions[(half.kind, s, m)].append((rank, i))
    for s in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            _check_one_chunk(positions, s, m)


def _check_one_chunk(positions: dict, s: int, m: int) -> None:
    def at(kind: ActionKind) -> list[int]:
        return [i for _, i in positions.get((kind, s, m), ())]

    f, b, w, bw = at(ActionKind.F), at(ActionKind.B), at(ActionKind.W), at(ActionKind.BW)
    where = f"stage {s} micro-batch {m}"
    found = f"found BW={len(bw)} B={len(b)} W={len(w)}"
    if len(f) != 1:
        raise ScheduleError(f"{where}: expected one F, found {len(f)}")
    if bw and (len(bw), b, w) != (1, [], []):
        raise ScheduleError(f"{where}: BW must be the only backward, {found}")
    if not bw:
        if (len(b), len(w)) != (1, 1):
            raise ScheduleError(f"{where}: expected one BW or one B and one W, {found}")
        if not f[0] < b[0] < w[0]:
            raise ScheduleError(f"{where}: order must be F < B < W on the owning rank")
    elif not f[0] < bw[0]:
        raise ScheduleError(f"{where}: BW runs before its F")


def check_w_fifo(schedule: Schedule) -> None:
    for rank, program in enumerate(schedule.programs):
        deferred: dict[int, list[int]] = defaultdict(list)
        popped: dict[int, list[int]] = defaultdict(list)
        for action in program:
            for half in action.halves():
                if half.kind is ActionKind.B:
                    deferred[half.stage].append(half.microbatch)
                elif half.kind is ActionKind.W:
                    popped[half.stage].append(half.microbatch)
        for stage, order in deferred.items():
            if popped.get(stage) != order:
                raise ScheduleError(
                    f"rank {rank} stage {stage}: W's {popped.get(stage)} do not pop the deferred "
                    f"backwards {order} in FIFO order"
                )


def check_dependencies(schedule: Schedule) -> None:
    simulate(schedule)


def check_comm(lowered: LoweredSchedule) -> None:
    schedule = lowered.schedule
    expected: Counter[tuple[int, Action]] = Counter()
    for rank, program in enumerate(schedule.programs):
        for action in program:
            for edge in cross_rank_inputs(schedule, rank, action):
                expected[(edge.src, send_action(edge))] += 1
                expected[(edge.dst, recv_action(edge))] += 1
    found: Counter[tuple[int, Action]] = Counter()
    channels: dict[tuple[int, int, bool], list[Edge]] = defaultdict(list)
    for rank, steps in enumerate(lowered.programs):
        for step in steps:
            if isinstance(step, Action):
                if step.is_comm:
                    raise ScheduleError(f"rank {rank}: {step} is outside a batch")
                continue
            if not step.ops or not all(op.is_comm for op in step.ops):
                raise ScheduleError(f"rank {rank}: batch {step} must hold communication only")
            for op in step.ops:
                found[(rank, op)] += 1
                edge = edge_of(rank, op)
                channels[(edge.src, edge.dst, op.kind.is_send)].append(edge)
        computes = tuple(s for s in steps if not isinstance(s, CommBatch))
        if computes != schedule.programs[rank]:
            raise ScheduleError(f"rank {rank}: lowering changed the compute actions")
    if found != expected:
        missing = sorted(str(op) + f"@{r}" for (r, op) in (expected - found))
        extra = sorted(str(op) + f"@{r}" for (r, op) in (found - expected))
        raise ScheduleError(f"send/recv mismatch: missing {missing[:8]}, unexpected {extra[:8]}")
    _check_placement(lowered)
    for (src, dst, is_send), edges in channels.items():
        if is_send and channels.get((src, dst, False)) != edges:
            raise ScheduleError(f"channel {src}->{dst}: sends and receives are in different orders")


def _check_placement(lowered: LoweredSchedule) -> None:
    """SEND after its producer, RECV before its consumer, on each rank's flat action list."""
    schedule = lowered.schedule
    for rank in range(schedule.num_ranks):
        flat = lowered.flat(rank)
        index = {a: i for i, a in enumerate(flat)}
        for i, action in enumerate(flat):
            if action.is_comm:
                continue
            for edge in cross_rank_inputs(schedule, rank, action):
                recv = recv_action(edge)
                if index[recv] > i:
                    raise ScheduleError(f"rank {rank}: {recv} comes after its consumer {action}")
            for edge in cross_rank_outputs(schedule, rank, action):
                send = send_action(edge)
                if index[send] < i:
                    raise ScheduleError(f"rank {rank}: {send} comes before its producer {action}")


def check_rendezvous(lowered: LoweredSchedule) -> None:
    """Replay the batches with NCCL rendezvous semantics and raise on a P2P deadlock.

    A rank posts its next batch only once its previous batch is complete. The k-th send on a
    channel pairs with the k-th receive on it (NCCL matches in order); an operation completes only
    when its partner is posted in the peer's current batch, and a batch completes when all its
    operations have. Compute actions never block here (their data dependencies are
    check_comm's and check_dependencies' business).
    """
    programs = lowered.programs
    batches = [[s for s in steps if isinstance(s, CommBatch)] for steps in programs]
    slot: dict[tuple[int, int], tuple[tuple, Edge]] = {}
    counts: Counter[tuple] = Counter()
    for rank, rank_batches in enumerate(batches):
        for b, batch in enumerate(rank_batches):
            for j, op in enumerate(batch.ops):
                edge = edge_of(rank, op)
                channel = (edge.src, edge.dst, op.kind.is_send)
                slot[(rank, b, j)] = ((edge.src, edge.dst, counts[channel], op.kind.is_send), edge)
                counts[channel] += 1
    current = [0] * len(batches)
    done: set[tuple] = set()
    while any(current[r] < len(batches[r]) for r in range(len(batches))):
        posted: dict[tuple, Edge] = {}
        for rank, b in enumerate(current):
            if b < len(batches[rank]):
                for j in range(len(batches[rank][b].ops)):
                    key, edge = slot[(rank, b, j)]
                    posted[key] = edge
        for key, edge in posted.items():
            partner = (*key[:3], not key[3])
            if partner in posted:
                if posted[partner] != edge:
                    other = posted[partner].token
                    raise ScheduleError(f"NCCL would pair {edge.token} with {other}")
                done.add(key)
        advanced = False
        for rank, b in enumerate(current):
            if b < len(batches[rank]) and all(
                slot[(rank, b, j)][0] in done for j in range(len(batches[rank][b].ops))
            ):
                current[rank] += 1
                advanced = True
        if not advanced:
            waiting = [
                f"rank {r} at {batches[r][b]}"
                for r, b in enumerate(current)
                if b < len(batches[r])
            ]
            raise ScheduleError("P2P deadlock under rendezvous semantics: " + "; ".join(waiting))


def validate(schedule: Schedule, costs: Optional[Costs] = None) -> LoweredSchedule:
    """Run every validator; return the lowered schedule (timed with ``costs``) they accepted."""
    check_compute(schedule)
    check_w_fifo(schedule)
    check_dependencies(schedule)
    lowered = lower(schedule, costs)
    check_comm(lowered)
    check_rendezvous(lowered)
    return lowered
