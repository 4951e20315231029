"""Helpers shared by the schedule builders: the argument check and the action constructors."""
from __future__ import annotations

from ..ir import Action, ActionKind


def require(ok: bool, param: str, message: str) -> None:
    """Reject a builder argument with a ValueError that names the offending parameter."""
    if not ok:
        raise ValueError(f"{param}: {message}")


def forward(stage: int, microbatch: int) -> Action:
    return Action(ActionKind.F, stage, microbatch)


def backward(stage: int, microbatch: int, split: bool) -> Action:
    """B (weight grad deferred to a later W) when ``split``, else the fused BW."""
    return Action(ActionKind.B if split else ActionKind.BW, stage, microbatch)


def weight(stage: int, microbatch: int) -> Action:
    return Action(ActionKind.W, stage, microbatch)
