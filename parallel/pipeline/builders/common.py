"""Helpers shared by the schedule builders: parameter checks and action constructors."""
from __future__ import annotations

from typing import Optional

from ..ir import Action, ActionKind


def require(ok: bool, param: str, message: str) -> None:
    """Reject a builder argument with a ValueError that names the offending parameter."""
    if not ok:
        raise ValueError(f"{param}: {message}")


def check_sizes(
    schedule: str,
    ranks: int,
    microbatches: int,
    virtual_stages: Optional[int],
    allowed_virtual: int,
) -> None:
    """Common checks; ``allowed_virtual`` is the only stages-per-rank value this builder knows."""
    require(ranks >= 1, "ranks", f"{schedule} needs ranks >= 1, got {ranks}")
    require(
        microbatches >= 1,
        "microbatches",
        f"{schedule} needs microbatches >= 1, got {microbatches}",
    )
    require(
        virtual_stages in (None, allowed_virtual),
        "virtual_stages",
        f"{schedule} places exactly {allowed_virtual} stage(s) per rank, got {virtual_stages}",
    )


def forward(stage: int, microbatch: int) -> Action:
    return Action(ActionKind.F, stage, microbatch)


def backward(stage: int, microbatch: int, split: bool) -> Action:
    """B (weight grad deferred to a later W) when ``split``, else the fused BW."""
    return Action(ActionKind.B if split else ActionKind.BW, stage, microbatch)


def weight(stage: int, microbatch: int) -> Action:
    return Action(ActionKind.W, stage, microbatch)
