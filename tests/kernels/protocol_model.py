"""CPU discrete-event model of the intranode ring-buffer protocol of kernels/intranode_*.cu.

Every warp role of the kernels is a coroutine (a generator) over explicit shared words: per ring
(channel, producer, consumer) the channel start/end (-v-1 encoded), the tail and the records in the
consumer's buffer, the head in the producer's buffer, and the combine receiver's shared
`next_slot` table read by the head keeper. Code between two `yield`s is one atomic step; a role
yields `Wait(ready, what)` to spin until `ready()` holds. A scheduler picks the next role: seeded
random, or exhaustively over all interleavings (stateless search with replay, pruned by a
fingerprint of the shared state and of each coroutine's frame).

Memory is modelled coarsely as the design suggests: records a producer writes stay invisible until
its next tail release publishes them, nothing else is ordered. Checks: exactly-once delivery, per-
stream order (rows by source rank, then token), 0 <= tail - head <= capacity at every step, and
termination (a state where every unfinished role waits is a deadlock).

The rules are the kernels' (chunked producer waits for room for a whole chunk; group tail publish;
consumer head release after reading; combine reducers announce the next slot they need, decoded
from the negative-head rewrite; the keeper releases the minimum over unretired reducers). Role
splits use the kernels' warp counts from csrc/params/constants.h unless a test shrinks them.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Generator, Sequence

from kernels_cuda import constants as C

Routing = Sequence[Sequence[Sequence[int]]]  # routing[src][token] = destination ranks of the token


class ProtocolViolation(AssertionError):
    """An invariant of the protocol failed (wrong record read, ring over capacity, ...)."""


class Deadlock(RuntimeError):
    """Every unfinished role is waiting."""


@dataclass
class Wait:
    ready: Callable[[], bool]
    what: str


Role = Generator["Wait | None", None, None]


def encode_count(value: int) -> int:
    return -value - 1


def decode_count(stored: int) -> int:
    return -stored - 1


def channel_range(num_tokens: int, num_channels: int, channel: int) -> tuple[int, int]:
    per_channel = -(-num_tokens // num_channels)
    begin = min(per_channel * channel, num_tokens)
    return begin, min(per_channel * channel + per_channel, num_tokens)


def rewrite_send_head(column: list[int], past_end: int) -> list[int]:
    """The cached notify's rewrite of one (channel, rank) column: -1 -> -(next present slot)-1."""
    out, nxt = list(column), past_end
    for i in range(len(out) - 1, -1, -1):
        if out[i] >= 0:
            nxt = out[i]
        else:
            out[i] = -nxt - 1
    return out


@dataclass(frozen=True)
class ModelConfig:
    num_ranks: int
    num_channels: int = 1
    chunk: int = 2                                  # num_max_send_tokens
    capacity: int = 4                               # num_max_recv_tokens
    num_reducers: int = C.COMBINE_WARPS - C.COMBINE_KEEPER_WARPS
    rewrite_heads: bool = True                      # the negative-head rewrite before combine


@dataclass
class Ring:
    """One (channel, producer, consumer) ring: tail/records in the consumer, head in the producer."""

    capacity: int
    start: int = 0
    end: int = 0
    tail: int = 0
    head: int = 0
    slots: list = field(default_factory=list)
    pending: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.slots = [None] * self.capacity

    def write(self, index: int, record: tuple) -> None:
        if index - self.head >= self.capacity:
            raise ProtocolViolation(f"record {index} written while head={self.head} (capacity {self.capacity})")
        self.pending[index] = record

    def publish_tail(self, tail: int) -> None:
        for index, record in self.pending.items():
            self.slots[index % self.capacity] = (index, record)
        self.pending.clear()
        self.tail = tail

    def read(self, index: int) -> tuple:
        if index >= self.tail:
            raise ProtocolViolation(f"record {index} read before the tail ({self.tail}) covered it")
        entry = self.slots[index % self.capacity]
        if entry is None or entry[0] != index:
            raise ProtocolViolation(f"slot of record {index} holds {entry}")
        return entry[1]

    def check(self) -> None:
        if not 0 <= self.tail - self.head <= self.capacity:
            raise ProtocolViolation(f"tail={self.tail} head={self.head} capacity={self.capacity}")

    def state(self) -> tuple:
        return self.start, self.end, self.tail, self.head, tuple(self.slots), tuple(sorted(self.pending.items()))


class World:
    """Shared words of one phase (dispatch or combine) plus what the roles delivered."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        r, ch = range(cfg.num_ranks), range(cfg.num_channels)
        self.rings = {(c, p, q): Ring(cfg.capacity) for c in ch for p in r for q in r}
        self.received: dict[tuple[int, int, int], list] = {(q, c, p): [] for c in ch for p in r for q in r}
        self.next_slot: dict[tuple[int, int, int, int], int] = {}
        self.retired: set[tuple[int, int, int]] = set()

    def check(self) -> None:
        for ring in self.rings.values():
            ring.check()

    def state(self) -> tuple:
        return (tuple(r.state() for r in self.rings.values()),
                tuple((k, tuple(v)) for k, v in self.received.items()),
                tuple(sorted(self.next_slot.items())), tuple(sorted(self.retired)))


# ----------------------------------------------------------------------------------- dispatch roles

def dispatch_sender(w: World, routing: Routing, send_head: list, me: int, channel: int, dst: int) -> Role:
    cfg = w.cfg
    ring = w.rings[channel, me, dst]
    prefix = [sum(1 for t in range(*channel_range(len(routing[me]), cfg.num_channels, c)) if dst in routing[me][t])
              for c in range(cfg.num_channels)]
    yield None
    ring.start = encode_count(sum(prefix[:channel]))
    yield None
    ring.end = encode_count(sum(prefix[:channel + 1]))
    begin, end = channel_range(len(routing[me]), cfg.num_channels, channel)
    token, tail = begin, 0
    while token < end:
        yield Wait(lambda: cfg.capacity - (tail - ring.head) >= cfg.chunk,
                   f"dispatch sender rank {me} ch {channel} -> {dst}: room for {cfg.chunk} past tail {tail}")
        sent = 0
        while token < end and sent < cfg.chunk:
            to_dst = dst in routing[me][token]
            send_head[me][token][dst] = tail if to_dst else -1
            if to_dst:
                ring.write(tail, (me, token))
                tail, sent = tail + 1, sent + 1
            token += 1
        yield None  # group barrier, then the leader's release store of the tail
        ring.publish_tail(tail)


def dispatch_receiver(w: World, me: int, channel: int, src: int) -> Role:
    ring = w.rings[channel, src, me]
    yield Wait(lambda: ring.start != 0 and ring.end != 0, f"dispatch receiver rank {me} ch {channel} <- {src}: counts")
    count = decode_count(ring.end) - decode_count(ring.start)
    head = 0
    while head < count:
        yield Wait(lambda: ring.tail > head, f"dispatch receiver rank {me} ch {channel} <- {src}: data past {head}")
        tail = ring.tail
        for index in range(head, tail):
            w.received[me, channel, src].append(ring.read(index))
            yield None
        ring.head = head = tail  # release store of the head into the producer's buffer


# ------------------------------------------------------------------------------------ combine roles

def combine_sender(w: World, rows: list, me: int, channel: int, dst: int) -> Role:
    """rows: the (source token) of each record this rank received from `dst` in `channel`, in slot order."""
    cfg = w.cfg
    ring = w.rings[channel, me, dst]
    yield None
    tail = 0
    while tail < len(rows):
        yield Wait(lambda: cfg.capacity - (tail - ring.head) >= cfg.chunk,
                   f"combine sender rank {me} ch {channel} -> {dst}: room for {cfg.chunk} past tail {tail}")
        n = min(cfg.chunk, len(rows) - tail)
        for j in range(n):
            ring.write(tail + j, (me, rows[tail + j]))
        tail += n
        yield None
        ring.publish_tail(tail)


def combine_reducer(w: World, send_head: list, me: int, channel: int, reducer: int) -> Role:
    cfg = w.cfg
    begin, end = channel_range(len(send_head[me]), cfg.num_channels, channel)
    yield None
    for token in range(begin + reducer, end, cfg.num_reducers):
        slots = send_head[me][token]
        for rank, slot in enumerate(slots):  # lanes announce the next slot they need
            w.next_slot[me, channel, reducer, rank] = slot if slot >= 0 else decode_count(slot)
        yield Wait(lambda: all(s < 0 or w.rings[channel, r, me].tail > s for r, s in enumerate(slots)),
                   f"combine reducer rank {me} ch {channel} warp {reducer}: token {token} slots {list(slots)}")
        for rank, slot in enumerate(slots):
            if slot >= 0:
                record = w.rings[channel, rank, me].read(slot)
                if record != (rank, token):
                    raise ProtocolViolation(f"rank {me} token {token} read {record} from rank {rank}")
                w.received[me, channel, rank].append(token)
        yield None
    w.retired.add((me, channel, reducer))


def combine_keeper(w: World, me: int, channel: int) -> Role:
    cfg = w.cfg
    published = [0] * cfg.num_ranks
    reducers = range(cfg.num_reducers)

    def lowest(rank: int) -> int:
        live = [w.next_slot[me, channel, r, rank] for r in reducers if (me, channel, r) not in w.retired]
        return min(live) if live else -1

    def all_retired() -> bool:
        return all((me, channel, r) in w.retired for r in reducers)

    yield None
    while True:
        yield Wait(lambda: all_retired() or any(lowest(r) > published[r] for r in range(cfg.num_ranks)),
                   f"combine keeper rank {me} ch {channel}: heads {published}")
        if all_retired():
            return
        for rank in range(cfg.num_ranks):
            value = lowest(rank)
            if value > published[rank]:
                w.rings[channel, rank, me].head = published[rank] = value  # head lives in the producer


# ------------------------------------------------------------------------------------------ phases

# Roles only share the rings they meet on: every ring has one consumer rank, and the roles feeding or
# draining one consumer's rings touch no other rank's rings. `consumer` keeps just that component,
# which is exact (other components cannot influence it) and keeps exhaustive searches small.

def _wanted(consumer: int | None, rank: int) -> bool:
    return consumer is None or consumer == rank


def build_dispatch(cfg: ModelConfig, routing: Routing,
                   consumer: int | None = None) -> tuple[World, dict[str, Role], list]:
    world = World(cfg)
    send_head = [[[-1] * cfg.num_ranks for _ in tokens] for tokens in routing]
    roles: dict[str, Role] = {}
    for me in range(cfg.num_ranks):
        for c in range(cfg.num_channels):
            for peer in range(cfg.num_ranks):
                if _wanted(consumer, peer):
                    roles[f"send{me}.{c}.{peer}"] = dispatch_sender(world, routing, send_head, me, c, peer)
                if _wanted(consumer, me):
                    roles[f"recv{me}.{c}.{peer}"] = dispatch_receiver(world, me, c, peer)
    return world, roles, send_head


def combine_inputs(cfg: ModelConfig, routing: Routing, send_head: list) -> tuple[list, list]:
    """(rows[me][channel][dst] for the combine senders, the rewritten send_head) from a dispatch."""
    rows = [[[[] for _ in range(cfg.num_ranks)] for _ in range(cfg.num_channels)] for _ in range(cfg.num_ranks)]
    for src, tokens in enumerate(routing):
        for c in range(cfg.num_channels):
            for t in range(*channel_range(len(tokens), cfg.num_channels, c)):
                for dst in sorted(set(tokens[t])):
                    rows[dst][c][src].append(t)
    heads = [[list(row) for row in per_rank] for per_rank in send_head]
    if cfg.rewrite_heads:
        for src, tokens in enumerate(routing):
            for c in range(cfg.num_channels):
                begin, end = channel_range(len(tokens), cfg.num_channels, c)
                for dst in range(cfg.num_ranks):
                    column = rewrite_send_head([heads[src][t][dst] for t in range(begin, end)], len(rows[dst][c][src]))
                    for t, value in zip(range(begin, end), column):
                        heads[src][t][dst] = value
    return rows, heads


def build_combine(cfg: ModelConfig, rows: list, send_head: list,
                  consumer: int | None = None) -> tuple[World, dict[str, Role]]:
    world = World(cfg)
    roles: dict[str, Role] = {}
    for me in range(cfg.num_ranks):
        for c in range(cfg.num_channels):
            for peer in range(cfg.num_ranks):
                if _wanted(consumer, peer):
                    roles[f"csend{me}.{c}.{peer}"] = combine_sender(world, rows[me][c][peer], me, c, peer)
            if not _wanted(consumer, me):
                continue
            roles[f"keeper{me}.{c}"] = combine_keeper(world, me, c)
            for r in range(cfg.num_reducers):
                for peer in range(cfg.num_ranks):  # zeroed before the block's __syncthreads
                    world.next_slot[me, c, r, peer] = 0
                roles[f"reduce{me}.{c}.{r}"] = combine_reducer(world, send_head, me, c, r)
    return world, roles


# --------------------------------------------------------------------------------------- scheduling

@dataclass
class Run:
    world: World
    roles: dict[str, Role]
    waits: dict[str, Wait | None]
    steps: int = 0

    def runnable(self) -> list[str]:
        return [n for n, w in self.waits.items() if w is None or w.ready()]

    def step(self, name: str) -> None:
        try:
            self.waits[name] = next(self.roles[name])
        except StopIteration:
            del self.waits[name]
        self.steps += 1
        self.world.check()

    def deadlock_report(self) -> str:
        return "; ".join(w.what for w in self.waits.values() if w is not None)

    def fingerprint(self) -> tuple:
        frames = []
        for name, gen in self.roles.items():
            frame = gen.gi_frame
            frames.append((name, None) if frame is None else
                          (name, frame.f_lasti, _freeze({k: v for k, v in frame.f_locals.items() if _plain(v)})))
        return self.world.state(), tuple(frames)


def _plain(value: object) -> bool:
    return isinstance(value, (int, str, type(None))) or (
        isinstance(value, (list, tuple)) and all(_plain(v) for v in value))


def _freeze(value: object) -> object:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def start(world: World, roles: dict[str, Role]) -> Run:
    return Run(world, roles, {name: None for name in roles})


def run_random(run: Run, seed: int, max_steps: int = 1_000_000) -> Run:
    """Run to completion choosing uniformly among runnable roles; raises Deadlock if stuck."""
    rng = random.Random(seed)
    while run.waits:
        ready = run.runnable()
        if not ready:
            raise Deadlock(run.deadlock_report())
        if run.steps >= max_steps:
            raise RuntimeError(f"no termination within {max_steps} steps")
        run.step(rng.choice(ready))
    return run


def explore(make_run: Callable[[], Run], on_final: Callable[[Run], None], max_states: int = 200_000) -> int:
    """Every interleaving (up to equal fingerprints): final states go to on_final, deadlocks raise.

    Returns the number of distinct states visited. Generators cannot be copied, so each state is
    reached by replaying its choice path from a fresh run.
    """
    seen: set = set()
    stack: list[tuple[int, ...]] = [()]
    while stack:
        path = stack.pop()
        run = make_run()
        for choice in path:
            run.step(run.runnable()[choice])
        key = run.fingerprint()
        if key in seen:
            continue
        seen.add(key)
        if len(seen) > max_states:
            raise RuntimeError(f"more than {max_states} states; shrink the case")
        ready = run.runnable()
        if not run.waits:
            on_final(run)
        elif not ready:
            raise Deadlock(run.deadlock_report())
        stack.extend(path + (i,) for i in range(len(ready)))
    return len(seen)


# ----------------------------------------------------------------------------------------- checks

def expected_dispatch(cfg: ModelConfig, routing: Routing, me: int, c: int, src: int) -> list:
    begin, end = channel_range(len(routing[src]), cfg.num_channels, c)
    return [(src, t) for t in range(begin, end) if me in routing[src][t]]


def check_dispatch(cfg: ModelConfig, routing: Routing, world: World, send_head: list,
                   consumer: int | None = None) -> None:
    """Each token once per destination rank, in source token order per (channel, source)."""
    for (me, c, src), got in world.received.items():
        if not _wanted(consumer, me):
            continue
        want = expected_dispatch(cfg, routing, me, c, src)
        if got != want:
            raise ProtocolViolation(f"rank {me} channel {c} from {src}: received {got}, expected {want}")
    for src, tokens in enumerate(routing):
        for t, dests in enumerate(tokens):
            for dst in range(cfg.num_ranks):
                if _wanted(consumer, dst) and (send_head[src][t][dst] >= 0) != (dst in dests):
                    raise ProtocolViolation(f"send_head[{src}][{t}][{dst}] = {send_head[src][t][dst]}")


def check_combine(cfg: ModelConfig, routing: Routing, world: World, consumer: int | None = None) -> None:
    """Each token's row read exactly once from every rank it went to."""
    for (me, c, src), got in world.received.items():
        if not _wanted(consumer, me):
            continue
        begin, end = channel_range(len(routing[me]), cfg.num_channels, c)
        want = [t for t in range(begin, end) if src in routing[me][t]]
        if sorted(got) != want or len(set(got)) != len(got):
            raise ProtocolViolation(f"rank {me} channel {c} from {src}: combined {got}, expected {want}")


def simulate(cfg: ModelConfig, routing: Routing, seed: int) -> tuple[int, int]:
    """Dispatch then combine under one seed, with every check; returns the steps of each phase."""
    world, roles, send_head = build_dispatch(cfg, routing)
    dispatch = run_random(start(world, roles), seed)
    check_dispatch(cfg, routing, world, send_head)
    rows, heads = combine_inputs(cfg, routing, send_head)
    world, roles = build_combine(cfg, rows, heads)
    combine = run_random(start(world, roles), seed + 1)
    check_combine(cfg, routing, world)
    return dispatch.steps, combine.steps


def random_routing(rng: random.Random, num_ranks: int, num_tokens: int, max_dests: int,
                   weights: Sequence[float] | None = None) -> list[list[list[int]]]:
    """routing[src][token]: 0..max_dests distinct destinations per token, optionally skewed by weights."""
    out = []
    for _ in range(num_ranks):
        tokens = []
        for _ in range(num_tokens):
            k = rng.randint(0, max_dests)
            chosen: set[int] = set()
            for _ in range(k):
                chosen.add(rng.choices(range(num_ranks), weights=weights)[0])
            tokens.append(sorted(chosen))
        out.append(tokens)
    return out

