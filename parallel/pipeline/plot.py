"""Per-rank timeline pictures of a simulated schedule (matplotlib, imported lazily)."""
from __future__ import annotations

from typing import Optional

from .ir import Action, ActionKind, Schedule
from .timeline import Timeline

_COLOURS = {
    ActionKind.F: (0.36, 0.61, 0.84),
    ActionKind.B: (0.44, 0.68, 0.28),
    ActionKind.W: (0.62, 0.49, 0.76),
    ActionKind.BW: (0.93, 0.49, 0.19),
}


def plot_timeline(timeline: Timeline, path: str, title: Optional[str] = None) -> None:
    """Draw one row per rank, one box per action coloured by kind, labelled by micro-batch.

    The second stage of a rank (V / interleaved placements) or the second direction (DualPipe)
    is drawn darker; an FB box is split, forward on top and backward below.
    """
    from matplotlib.figure import Figure

    schedule = timeline.schedule
    ranks = schedule.num_ranks
    span = timeline.makespan
    fig = Figure(figsize=(12, 0.45 * ranks + 1.6))
    ax = fig.add_subplot()
    font = max(4.0, min(8.0, 300.0 / max(span, 1.0)))
    for rank, program in enumerate(schedule.programs):
        y = ranks - 1 - rank
        for action, t0, t1 in zip(program, timeline.start[rank], timeline.end[rank]):
            halves = action.halves()
            height = 0.8 / len(halves)
            for i, half in enumerate(halves):
                bottom = y + 0.4 - (i + 1) * height
                colour = _shade(_COLOURS[half.kind], _shade_level(schedule, rank, half))
                ax.add_patch(_box(t0, bottom, t1 - t0, height, colour))
                ax.text(
                    (t0 + t1) / 2, bottom + height / 2, str(half.microbatch),
                    ha="center", va="center", fontsize=font if len(halves) == 1 else font * 0.8,
                )
    ax.set_xlim(0, span)
    ax.set_ylim(-0.6, ranks - 0.4)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {ranks - 1 - y}" for y in range(ranks)])
    costs = timeline.costs
    ax.set_xlabel(
        f"time (per stage: F={costs.f:g}, B={costs.b:g}, W={costs.w:g}, comm={costs.comm:g})"
    )
    ax.set_title(
        title
        or f"{schedule.name}: {ranks} ranks, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} micro-batches; makespan {span:g}, bubble {timeline.bubble:g}",
        fontsize=10,
    )
    ax.legend(handles=_legend(schedule), loc="center left", bbox_to_anchor=(1.0, 0.5),
              fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _legend(schedule: Schedule) -> list:
    from matplotlib.patches import Patch

    actions = [a for program in schedule.programs for a in program]
    kinds = {h.kind for a in actions for h in a.halves()}
    legend = [Patch(color=c, label=k.value) for k, c in _COLOURS.items() if k in kinds]
    if any(a.kind is ActionKind.FB for a in actions):
        legend.append(Patch(color="white", label="FB: F over B"))
    darker = _shade((0.6, 0.6, 0.6), 1.0)
    if schedule.placement.num_directions == 2:
        legend.append(Patch(color=darker, label="darker: direction 1"))
    elif schedule.num_stages > schedule.num_ranks:
        legend.append(Patch(color=darker, label="darker: later stage"))
    return legend


def _box(x: float, y: float, width: float, height: float, colour: tuple):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), width, height, facecolor=colour, edgecolor="white", linewidth=0.6)


def _shade_level(schedule: Schedule, rank: int, half: Action) -> float:
    """0 for a rank's first stage (or direction 0), up to 1 for its last."""
    if schedule.placement.num_directions == 2:
        return float(schedule.direction(half.microbatch))
    stages = schedule.placement.stages_on(rank)
    return stages.index(half.stage) / max(1, len(stages) - 1)


def _shade(colour: tuple, level: float) -> tuple:
    factor = 1.0 - 0.4 * level
    return tuple(c * factor for c in colour)
