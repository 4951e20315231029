"""CPU model of the two-hop (internode, node-limited) ring protocol, in the style of protocol_model.py.

Ranks are (node n, GPU g), rank = n * G + g. Per channel:

Dispatch (source rank s = (n, g)):
- `kRdmaSenderWarps` sender warps walk the channel's tokens in rounds (token k goes to warp k % W);
  all warps count every token, so they agree on each record's slot in every node's RDMA ring; the
  handling warp waits for room in each destination node's ring, stages one record per node
  (token, GPU bitmask of that node) and records `send_rdma_head`; a round barrier follows each round;
- the sender coordinator puts released records in chunks (`rdma_chunk`, or all that remain) into
  the RDMA ring of rail peer (m, g), publishing the tail after the data, nodes in rotated order;
- forwarder j of rank (m, g) reads the rings from every source node (round robin), copies the
  records whose bit j is set into the NVLink ring to (m, j) after waiting for room for a whole
  `nvl_chunk`, records `send_nvl_head`, and announces how far it consumed each RDMA ring;
- the forwarder coordinator releases an RDMA head (into the producer) as the minimum over the
  unretired forwarders, lazily: only once it moved by `rdma_chunk`;
- NVLink receiver (m, j) for forwarder g drains its ring (merged stream of all source nodes).

Combine mirrors it: NVLink senders (m, j) send the rows they got from (n, g) back to forwarder
(m, g) in the sub-ring of origin node n (capacity nvl_capacity / nodes); forwarder warp n of (m, g)
walks node n's dispatch records in order, waits for the rows of every GPU that had the token
(`send_nvl_head`, absent entries rewritten to the next present slot), reduces them into one record
per chunk slot of the RDMA ring back to (n, g) after waiting for room for the chunk, and announces
its next needed slot per GPU for the NVLink head coordinator; `kRdmaReceiverWarps` receiver warps
of (n, g) stride over the original tokens, wait for every node's record (`send_rdma_head`,
rewritten likewise), and the RDMA head coordinator releases the minimum over them lazily.

Checks: exactly-once delivery per (token, destination rank) and per (token, node) on the way back,
per-stream order, 0 <= tail - head <= capacity, termination; a violating config deadlocks.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from kernels_cuda import constants as C
from tests.kernels.protocol_model import (ProtocolViolation, Ring, Role, Run, Wait, channel_range, decode_count,
                                         rewrite_send_head, run_random, start)

Routing = Sequence[Sequence[Sequence[int]]]  # routing[src rank][token] = destination ranks


@dataclass(frozen=True)
class TwoHopConfig:
    num_nodes: int
    gpus_per_node: int
    num_channels: int = 1
    nvl_chunk: int = 1
    nvl_capacity: int = 4
    rdma_chunk: int = 1
    rdma_capacity: int = 2
    sender_warps: int = C.RDMA_SENDER_WARPS
    receiver_warps: int = C.RDMA_RECEIVER_WARPS
    rewrite_heads: bool = True

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.gpus_per_node


class StagedRing(Ring):
    """An RDMA ring: records are staged, then a chunk [.., upto) is put and the tail published."""

    def put(self, upto: int) -> None:
        for index in [i for i in self.pending if i < upto]:
            self.slots[index % self.capacity] = (index, self.pending.pop(index))
        self.tail = upto


class TwoHopWorld:
    def __init__(self, cfg: TwoHopConfig) -> None:
        self.cfg = cfg
        self.rings: dict[tuple, Ring] = {}
        self.meta: dict[tuple, object] = {}
        self.progress: dict[tuple, int] = {}   # round counters, forwarder heads, announced slots
        self.retired: set[tuple] = set()
        self.received: dict[tuple, list] = {}

    def ring(self, key: tuple, capacity: int, staged: bool = False) -> Ring:
        if key not in self.rings:
            self.rings[key] = StagedRing(capacity) if staged else Ring(capacity)
        return self.rings[key]

    def check(self) -> None:
        for ring in self.rings.values():
            ring.check()

    def state(self) -> tuple:
        return (tuple(sorted((k, r.state()) for k, r in self.rings.items())), tuple(sorted(self.progress.items())),
                tuple(sorted(self.retired)))


def _nodes_of(cfg: TwoHopConfig, dests: Sequence[int]) -> list[int]:
    return sorted({d // cfg.gpus_per_node for d in dests})


def _mask(cfg: TwoHopConfig, dests: Sequence[int], node: int) -> int:
    return sum(1 << (d % cfg.gpus_per_node) for d in set(dests) if d // cfg.gpus_per_node == node)


# ----------------------------------------------------------------------------------------- dispatch

def rdma_sender(w: TwoHopWorld, routing: Routing, send_rdma_head: list, s: int, c: int, warp: int) -> Role:
    cfg = w.cfg
    W = cfg.sender_warps
    begin, end = channel_range(len(routing[s]), cfg.num_channels, c)
    rings = {m: w.ring(("rdma", c, s, m), cfg.rdma_capacity, staged=True) for m in range(cfg.num_nodes)}
    if warp == 0:  # channel meta first: records per node and per GPU of the node
        for m in range(cfg.num_nodes):
            tokens = [t for t in range(begin, end) if m in _nodes_of(cfg, routing[s][t])]
            per_gpu = [sum(1 for t in tokens if (_mask(cfg, routing[s][t], m) >> j) & 1)
                       for j in range(cfg.gpus_per_node)]
            w.meta["rdma", c, s, m] = (len(tokens), per_gpu)
            yield None
    slot = [0] * cfg.num_nodes
    for k, t in enumerate(range(begin, end)):
        nodes = _nodes_of(cfg, routing[s][t])
        if k % W == warp:
            for m in range(cfg.num_nodes):
                send_rdma_head[s][t][m] = slot[m] if m in nodes else -1
            for m in nodes:
                ring, index = rings[m], slot[m]
                yield Wait(lambda ring=ring, index=index: index - ring.head < ring.capacity,
                           f"rdma sender {s} ch {c} warp {warp} -> node {m}: room for slot {index}")
                ring.write(index, (s, t, _mask(cfg, routing[s][t], m)))
        for m in nodes:
            slot[m] += 1
        if k % W == W - 1 or t == end - 1:  # round barrier of the sender warps
            done = k // W + 1
            w.progress["round", c, s, warp] = done
            yield Wait(lambda done=done: all(w.progress.get(("round", c, s, v), 0) >= done for v in range(W)),
                       f"rdma sender {s} ch {c} warp {warp}: round barrier {done}")


def rdma_coordinator(w: TwoHopWorld, routing: Routing, s: int, c: int) -> Role:
    cfg = w.cfg
    W, N = cfg.sender_warps, cfg.num_nodes
    begin, end = channel_range(len(routing[s]), cfg.num_channels, c)
    to_node = [[t for t in range(begin, end) if m in _nodes_of(cfg, routing[s][t])] for m in range(N)]
    issued = [0] * N

    def released(m: int) -> int:
        rounds = min(w.progress.get(("round", c, s, v), 0) for v in range(W))
        return sum(1 for t in to_node[m] if t - begin < rounds * W)

    def ready(m: int) -> bool:
        r = released(m)
        return r - issued[m] >= cfg.rdma_chunk or (r == len(to_node[m]) and r > issued[m])

    yield None
    while any(issued[m] < len(to_node[m]) for m in range(N)):
        yield Wait(lambda: any(ready(m) for m in range(N)), f"rdma coordinator {s} ch {c}: issued {issued}")
        for i in range(N):
            m = (i + c + s // cfg.gpus_per_node) % N  # rotated order spreads incast
            if ready(m):
                issued[m] += min(released(m) - issued[m], cfg.rdma_chunk)
                w.rings["rdma", c, s, m].put(issued[m])
                yield None


def forwarder(w: TwoHopWorld, send_nvl_head: dict, f: int, c: int, j: int) -> Role:
    cfg = w.cfg
    G, N = cfg.gpus_per_node, cfg.num_nodes
    m, g = divmod(f, G)
    d = m * G + j
    sources = [n * G + g for n in range(N)]
    yield Wait(lambda: all(("rdma", c, s, m) in w.meta for s in sources), f"forwarder {f} ch {c} -> {d}: meta")
    counts = [w.meta["rdma", c, s, m][0] for s in sources]
    for n, s in enumerate(sources):
        w.meta["nvl", c, f, d, n] = w.meta["rdma", c, s, m][1][j]
        yield None
    out = w.ring(("nvl", c, f, d), cfg.nvl_capacity)
    consumed, sub, tail, turn = [0] * N, [0] * N, 0, 0
    while any(consumed[n] < counts[n] for n in range(N)):
        yield Wait(lambda: cfg.nvl_capacity - (tail - out.head) >= cfg.nvl_chunk,
                   f"forwarder {f} ch {c} -> {d}: room for {cfg.nvl_chunk} past {tail}")

        def has_data(n: int) -> bool:
            return consumed[n] < counts[n] and w.ring(("rdma", c, sources[n], m), cfg.rdma_capacity, True).tail > consumed[n]

        yield Wait(lambda: any(has_data(n) for n in range(N)), f"forwarder {f} ch {c} -> {d}: RDMA data {consumed}")
        n = next((turn + i) % N for i in range(N) if has_data((turn + i) % N))
        turn = n + 1
        ring, sent = w.rings["rdma", c, sources[n], m], 0
        while consumed[n] < ring.tail and sent < cfg.nvl_chunk:
            src, t, mask = ring.read(consumed[n])
            if (mask >> j) & 1:
                out.write(tail, (src, t))
                send_nvl_head[c, f, n][consumed[n]][j] = sub[n]
                sub[n], tail, sent = sub[n] + 1, tail + 1, sent + 1
            else:
                send_nvl_head[c, f, n][consumed[n]][j] = -1
            consumed[n] += 1
        yield None
        out.publish_tail(tail)
        w.progress["fwd", c, f, j, n] = consumed[n]
    w.retired.add(("fwd", c, f, j))


def forward_coordinator(w: TwoHopWorld, f: int, c: int) -> Role:
    cfg = w.cfg
    G, N = cfg.gpus_per_node, cfg.num_nodes
    m, g = divmod(f, G)
    published = [0] * N

    def lowest(n: int) -> int | None:
        live = [w.progress.get(("fwd", c, f, j, n), 0) for j in range(G) if ("fwd", c, f, j) not in w.retired]
        return min(live) if live else None

    def all_retired() -> bool:
        return all(("fwd", c, f, j) in w.retired for j in range(G))

    def due(n: int) -> bool:
        low = lowest(n)
        return low is not None and low - published[n] >= cfg.rdma_chunk

    yield None
    while True:
        yield Wait(lambda: all_retired() or any(due(n) for n in range(N)), f"forward coordinator {f} ch {c}: {published}")
        if all_retired():
            return
        for n in range(N):
            if due(n):
                published[n] = lowest(n)
                w.rings["rdma", c, n * G + g, m].head = published[n]  # remote atomic into the producer


def nvl_receiver(w: TwoHopWorld, d: int, c: int, g: int) -> Role:
    cfg = w.cfg
    G, N = cfg.gpus_per_node, cfg.num_nodes
    f = (d // G) * G + g
    keys = [("nvl", c, f, d, n) for n in range(N)]
    yield Wait(lambda: all(k in w.meta for k in keys), f"nvl receiver {d} ch {c} <- {f}: meta")
    total = sum(w.meta[k] for k in keys)
    ring = w.ring(("nvl", c, f, d), cfg.nvl_capacity)
    head = 0
    while head < total:
        yield Wait(lambda: ring.tail > head, f"nvl receiver {d} ch {c} <- {f}: data past {head}")
        tail = ring.tail
        for index in range(head, tail):
            src, t = ring.read(index)
            w.received.setdefault((d, c, src), []).append(t)
            yield None
        ring.head = head = tail


def build_dispatch(cfg: TwoHopConfig, routing: Routing) -> tuple[TwoHopWorld, dict[str, Role], list, dict]:
    w = TwoHopWorld(cfg)
    R, G, N = cfg.num_ranks, cfg.gpus_per_node, cfg.num_nodes
    send_rdma_head = [[[-1] * N for _ in tokens] for tokens in routing]
    send_nvl_head: dict = {}
    for c in range(cfg.num_channels):
        for s in range(R):
            begin, end = channel_range(len(routing[s]), cfg.num_channels, c)
            for m in range(N):
                records = sum(1 for t in range(begin, end) if m in _nodes_of(cfg, routing[s][t]))
                send_nvl_head[c, m * G + s % G, s // G] = [[-1] * G for _ in range(records)]
    roles: dict[str, Role] = {}
    for c in range(cfg.num_channels):
        for r in range(R):
            for v in range(cfg.sender_warps):
                roles[f"send{r}.{c}.{v}"] = rdma_sender(w, routing, send_rdma_head, r, c, v)
            roles[f"scoord{r}.{c}"] = rdma_coordinator(w, routing, r, c)
            for j in range(G):
                roles[f"fwd{r}.{c}.{j}"] = forwarder(w, send_nvl_head, r, c, j)
                roles[f"recv{r}.{c}.{j}"] = nvl_receiver(w, r, c, j)
            roles[f"fcoord{r}.{c}"] = forward_coordinator(w, r, c)
    return w, roles, send_rdma_head, send_nvl_head


def check_dispatch(cfg: TwoHopConfig, routing: Routing, w: TwoHopWorld) -> None:
    """Each token once per destination rank, in source token order per (channel, source rank)."""
    for d in range(cfg.num_ranks):
        for c in range(cfg.num_channels):
            for s, tokens in enumerate(routing):
                begin, end = channel_range(len(tokens), cfg.num_channels, c)
                want = [t for t in range(begin, end) if d in tokens[t]]
                got = w.received.get((d, c, s), [])
                if got != want:
                    raise ProtocolViolation(f"rank {d} channel {c} from {s}: received {got}, expected {want}")


# ------------------------------------------------------------------------------------------ combine

def nvl_sender(w: TwoHopWorld, rows: list, d: int, c: int, g: int, n: int) -> Role:
    cfg = w.cfg
    f = (d // cfg.gpus_per_node) * cfg.gpus_per_node + g
    ring = w.ring(("sub", c, d, f, n), cfg.nvl_capacity // cfg.num_nodes)
    yield None
    tail = 0
    while tail < len(rows):
        yield Wait(lambda: ring.capacity - (tail - ring.head) >= cfg.nvl_chunk,
                   f"combine nvl sender {d} ch {c} -> {f} origin {n}: room for {cfg.nvl_chunk} past {tail}")
        count = min(cfg.nvl_chunk, len(rows) - tail)
        for i in range(count):
            ring.write(tail + i, (d, rows[tail + i]))
        tail += count
        yield None
        ring.publish_tail(tail)


def combine_forwarder(w: TwoHopWorld, records: list, heads: list, f: int, c: int, n: int) -> Role:
    """records: the tokens node n sent this rank in dispatch (RDMA order); heads[i][j]: sub-ring slots."""
    cfg = w.cfg
    G = cfg.gpus_per_node
    m, g = divmod(f, G)
    s = n * G + g
    out = w.ring(("back", c, f, s), cfg.rdma_capacity)
    yield None
    for first in range(0, len(records), cfg.rdma_chunk):
        count = min(cfg.rdma_chunk, len(records) - first)
        yield Wait(lambda: out.capacity - (first - out.head) >= count,
                   f"combine forwarder {f} ch {c} origin {n}: RDMA room for {count} past {first}")
        for i in range(first, first + count):
            slots = heads[i]
            for j, slot in enumerate(slots):
                w.progress["nvlnext", c, f, n, j] = slot if slot >= 0 else decode_count(slot)
            yield Wait(lambda slots=slots: all(
                slot < 0 or w.ring(("sub", c, m * G + j, f, n), cfg.nvl_capacity // cfg.num_nodes).tail > slot
                for j, slot in enumerate(slots)),
                f"combine forwarder {f} ch {c} origin {n}: token {records[i]} slots {slots}")
            for j, slot in enumerate(slots):
                if slot >= 0 and w.rings["sub", c, m * G + j, f, n].read(slot) != (m * G + j, records[i]):
                    raise ProtocolViolation(f"forwarder {f} read a wrong row for token {records[i]} from GPU {j}")
            out.write(i, (m, records[i]))
            yield None
        out.publish_tail(first + count)
    w.retired.add(("cfwd", c, f, n))


def nvl_coordinator(w: TwoHopWorld, f: int, c: int) -> Role:
    cfg = w.cfg
    G, N = cfg.gpus_per_node, cfg.num_nodes
    m = f // G
    published = {(n, j): 0 for n in range(N) for j in range(G)}

    def due(n: int, j: int) -> bool:
        return ("cfwd", c, f, n) not in w.retired and w.progress.get(("nvlnext", c, f, n, j), 0) > published[n, j]

    def all_retired() -> bool:
        return all(("cfwd", c, f, n) in w.retired for n in range(N))

    yield None
    while True:
        yield Wait(lambda: all_retired() or any(due(*k) for k in published), f"nvl coordinator {f} ch {c}")
        if all_retired():
            return
        for n, j in published:
            if due(n, j):
                published[n, j] = w.progress["nvlnext", c, f, n, j]
                w.ring(("sub", c, m * G + j, f, n), cfg.nvl_capacity // N).head = published[n, j]


def rdma_receiver(w: TwoHopWorld, heads: list, s: int, c: int, warp: int, num_tokens: int) -> Role:
    cfg = w.cfg
    G = cfg.gpus_per_node
    begin, end = channel_range(num_tokens, cfg.num_channels, c)
    yield None
    for t in range(begin + warp, end, cfg.receiver_warps):
        slots = heads[t]
        for m, slot in enumerate(slots):
            w.progress["rdmanext", c, s, warp, m] = slot if slot >= 0 else decode_count(slot)
        yield Wait(lambda slots=slots: all(
            slot < 0 or w.ring(("back", c, m * G + s % G, s), cfg.rdma_capacity).tail > slot
            for m, slot in enumerate(slots)),
            f"combine rdma receiver {s} ch {c} warp {warp}: token {t} slots {slots}")
        for m, slot in enumerate(slots):
            if slot >= 0:
                if w.rings["back", c, m * G + s % G, s].read(slot) != (m, t):
                    raise ProtocolViolation(f"rank {s} token {t}: wrong record from node {m}")
                w.received.setdefault((s, c, m), []).append(t)
        yield None
    w.retired.add(("crecv", c, s, warp))


def rdma_head_coordinator(w: TwoHopWorld, s: int, c: int) -> Role:
    cfg = w.cfg
    G, N, W = cfg.gpus_per_node, cfg.num_nodes, cfg.receiver_warps
    published = [0] * N

    def lowest(m: int) -> int | None:
        live = [w.progress.get(("rdmanext", c, s, v, m), 0) for v in range(W) if ("crecv", c, s, v) not in w.retired]
        return min(live) if live else None

    def due(m: int) -> bool:
        low = lowest(m)
        return low is not None and low - published[m] >= cfg.rdma_chunk

    def all_retired() -> bool:
        return all(("crecv", c, s, v) in w.retired for v in range(W))

    yield None
    while True:
        yield Wait(lambda: all_retired() or any(due(m) for m in range(N)), f"rdma head coordinator {s} ch {c}")
        if all_retired():
            return
        for m in range(N):
            if due(m):
                published[m] = lowest(m)
                w.ring(("back", c, m * G + s % G, s), cfg.rdma_capacity).head = published[m]


def build_combine(cfg: TwoHopConfig, routing: Routing, dispatched: TwoHopWorld, send_rdma_head: list,
                  send_nvl_head: dict) -> tuple[TwoHopWorld, dict[str, Role]]:
    w = TwoHopWorld(cfg)
    R, G, N = cfg.num_ranks, cfg.gpus_per_node, cfg.num_nodes
    roles: dict[str, Role] = {}
    rdma_heads = [[list(row) for row in per_rank] for per_rank in send_rdma_head]
    nvl_heads = {k: [list(row) for row in v] for k, v in send_nvl_head.items()}
    for c in range(cfg.num_channels):
        for s in range(R):
            begin, end = channel_range(len(routing[s]), cfg.num_channels, c)
            for m in range(N):
                records = [t for t in range(begin, end) if m in _nodes_of(cfg, routing[s][t])]
                f = m * G + s % G
                heads = nvl_heads[c, f, s // G]
                if cfg.rewrite_heads:
                    column = rewrite_send_head([rdma_heads[s][t][m] for t in range(begin, end)], len(records))
                    for t, value in zip(range(begin, end), column):
                        rdma_heads[s][t][m] = value
                    for j in range(G):
                        sub_count = sum(1 for row in heads if row[j] >= 0)
                        column = rewrite_send_head([row[j] for row in heads], sub_count)
                        for row, value in zip(heads, column):
                            row[j] = value
                roles[f"cfwd{f}.{c}.{s // G}"] = combine_forwarder(w, records, heads, f, c, s // G)
    for c in range(cfg.num_channels):
        for r in range(R):
            for g in range(G):
                for n in range(N):
                    rows = dispatched.received.get((r, c, n * G + g), [])
                    roles[f"csend{r}.{c}.{g}.{n}"] = nvl_sender(w, rows, r, c, g, n)
            roles[f"ncoord{r}.{c}"] = nvl_coordinator(w, r, c)
            for v in range(cfg.receiver_warps):
                roles[f"crecv{r}.{c}.{v}"] = rdma_receiver(w, rdma_heads[r], r, c, v, len(routing[r]))
            roles[f"rcoord{r}.{c}"] = rdma_head_coordinator(w, r, c)
    return w, roles


def check_combine(cfg: TwoHopConfig, routing: Routing, w: TwoHopWorld) -> None:
    """Each token's partial sum read exactly once from every node it went to."""
    for s, tokens in enumerate(routing):
        for c in range(cfg.num_channels):
            begin, end = channel_range(len(tokens), cfg.num_channels, c)
            for m in range(cfg.num_nodes):
                want = [t for t in range(begin, end) if m in _nodes_of(cfg, tokens[t])]
                got = w.received.get((s, c, m), [])
                if sorted(got) != want or len(set(got)) != len(got):
                    raise ProtocolViolation(f"rank {s} channel {c} from node {m}: combined {got}, expected {want}")


def simulate(cfg: TwoHopConfig, routing: Routing, seed: int) -> tuple[int, int]:
    """Dispatch then combine under one seed, with every check; returns the steps of each phase."""
    world, roles, rdma_heads, nvl_heads = build_dispatch(cfg, routing)
    dispatch: Run = run_random(start(world, roles), seed)  # type: ignore[arg-type]
    check_dispatch(cfg, routing, world)
    cworld, croles = build_combine(cfg, routing, world, rdma_heads, nvl_heads)
    combine: Run = run_random(start(cworld, croles), seed + 1)  # type: ignore[arg-type]
    check_combine(cfg, routing, cworld)
    return dispatch.steps, combine.steps


def node_limited_routing(rng: random.Random, cfg: TwoHopConfig, num_tokens: int, max_nodes: int,
                         max_dests: int) -> list[list[list[int]]]:
    """routing[src][token]: up to max_dests ranks inside at most max_nodes nodes (0 dests allowed)."""
    out = []
    for _ in range(cfg.num_ranks):
        tokens = []
        for _ in range(num_tokens):
            nodes = rng.sample(range(cfg.num_nodes), rng.randint(0, min(max_nodes, cfg.num_nodes)))
            ranks = [n * cfg.gpus_per_node + j for n in nodes for j in range(cfg.gpus_per_node)]
            tokens.append(sorted(rng.sample(ranks, min(len(ranks), rng.randint(1, max_dests)))) if ranks else [])
        out.append(tokens)
    return out
