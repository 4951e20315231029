"""Data dependencies between compute actions.

Every compute action produces tokens and waits for tokens. ``Token(F, s, m)``: the output of
stage s's forward of micro-batch m; ``Token(B, s, m)``: the gradient w.r.t. stage s's input
(produced by B or BW); ``Token(W, s, m)``: stage s's weight gradient of m is done. The rules are
the same for every schedule; only the placement decides which edges cross ranks.
"""
from __future__ import annotations

from typing import NamedTuple

from .ir import Action, ActionKind, Schedule


class Token(NamedTuple):
    kind: ActionKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}.{self.microbatch}"


class Edge(NamedTuple):
    """A cross-rank data transfer: ``token`` travels from rank ``src`` to rank ``dst``."""

    token: Token
    src: int
    dst: int


def produces(action: Action) -> tuple[Token, ...]:
    out: list[Token] = []
    for half in action.halves():
        if half.kind is ActionKind.BW:
            out.append(Token(ActionKind.B, half.stage, half.microbatch))
            out.append(Token(ActionKind.W, half.stage, half.microbatch))
        else:
            out.append(Token(half.kind, half.stage, half.microbatch))
    return tuple(out)


def requires(action: Action, num_stages: int) -> tuple[Token, ...]:
    out: list[Token] = []
    for half in action.halves():
        s, m = half.stage, half.microbatch
        if half.kind is ActionKind.F:
            if s > 0:
                out.append(Token(ActionKind.F, s - 1, m))
        elif half.kind is ActionKind.W:
            out.append(Token(ActionKind.B, s, m))
        else:
            out.append(Token(ActionKind.F, s, m))
            if s < num_stages - 1:
                out.append(Token(ActionKind.B, s + 1, m))
    return tuple(out)


def producer_rank(schedule: Schedule, token: Token) -> int:
    return schedule.rank_of(token.stage, token.microbatch)


def cross_rank_inputs(schedule: Schedule, rank: int, action: Action) -> tuple[Edge, ...]:
    """The tokens ``action`` on ``rank`` needs from other ranks, as edges."""
    edges = []
    for token in requires(action, schedule.num_stages):
        src = producer_rank(schedule, token)
        if src != rank:
            edges.append(Edge(token, src, rank))
    return tuple(edges)


def cross_rank_outputs(schedule: Schedule, rank: int, action: Action) -> tuple[Edge, ...]:
    """The tokens ``action`` on ``rank`` produces for a consumer on another rank, as edges."""
    edges = []
    for token in produces(action):
        s, m = token.stage, token.microbatch
        if token.kind is ActionKind.F and s + 1 < schedule.num_stages:
            dst = schedule.rank_of(s + 1, m)
        elif token.kind is ActionKind.B and s > 0:
            dst = schedule.rank_of(s - 1, m)
        else:
            continue
        if dst != rank:
            edges.append(Edge(token, rank, dst))
    return tuple(edges)


def send_action(edge: Edge) -> Action:
    """The SEND on ``edge.src``: names the local stage whose output (or input grad) leaves."""
    kind = ActionKind.SEND_F if edge.token.kind is ActionKind.F else ActionKind.SEND_B
    return Action(kind, edge.token.stage, edge.token.microbatch, peer=edge.dst)


def recv_action(edge: Edge) -> Action:
    """The RECV on ``edge.dst``: names the local stage that consumes what arrives."""
    token = edge.token
    if token.kind is ActionKind.F:
        return Action(ActionKind.RECV_F, token.stage + 1, token.microbatch, peer=edge.src)
    return Action(ActionKind.RECV_B, token.stage - 1, token.microbatch, peer=edge.src)


def edge_of(rank: int, action: Action) -> Edge:
    """Inverse of send_action / recv_action for a comm action found on ``rank``."""
    kind = action.kind
    assert action.peer is not None
    if kind is ActionKind.SEND_F:
        return Edge(Token(ActionKind.F, action.stage, action.microbatch), rank, action.peer)
    if kind is ActionKind.SEND_B:
        return Edge(Token(ActionKind.B, action.stage, action.microbatch), rank, action.peer)
    if kind is ActionKind.RECV_F:
        return Edge(Token(ActionKind.F, action.stage - 1, action.microbatch), action.peer, rank)
    if kind is ActionKind.RECV_B:
        return Edge(Token(ActionKind.B, action.stage + 1, action.microbatch), action.peer, rank)
    raise ValueError(f"not a communication action: {action}")
