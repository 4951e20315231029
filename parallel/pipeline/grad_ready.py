"""When each parameter's gradient is final within a step, counted from the rank's lowered program.

A weight of the split Linear family (`Linear`, `GroupedLinear`) receives its gradient in the W (or
BW) of every micro-batch of every local stage that uses it; any other parameter (norms, embedding,
router) in the B (or BW). Counting those actions in the program gives each parameter its number of
pending contributions; the runtime reports every compute action it finished, and a parameter whose
count drops to zero is handed out as ready. The order only depends on the program, so every
data-parallel replica of a pipeline rank releases the same parameters in the same order, which is
what lets them start their collectives as the step goes (Megatron and ZB start a bucket's reduction
after its last W the same way).
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Sequence

from torch import nn

from model.layers import GroupedLinear, Linear

from .ir import Action, ActionKind, ScheduleError, Step


def split_weights(modules: Iterable[nn.Module]) -> set[int]:
    """ids of the parameters whose weight gradient the W store defers (the split Linear family)."""
    return {id(m.weight) for module in modules for m in module.modules() if isinstance(m, (Linear, GroupedLinear))}


class GradientReadiness:
    """Pending gradient contributions per parameter of one pipeline rank, for one step at a time.

    `stage_params` maps each local stage to the parameters its forward uses (a parameter may
    belong to several stages, e.g. the shared embedding of a V placement); `split` holds the ids
    of deferred-W weights.
    """

    def __init__(self, program: Sequence[Step], stage_params: Mapping[int, Sequence[nn.Parameter]],
                 split: set[int]) -> None:
        self._touched: dict[tuple[ActionKind, int], list[nn.Parameter]] = {}
        for stage, params in stage_params.items():
            tracked = list(dict.fromkeys(params))
            self._touched[(ActionKind.B, stage)] = [p for p in tracked if id(p) not in split]
            self._touched[(ActionKind.W, stage)] = [p for p in tracked if id(p) in split]
            self._touched[(ActionKind.BW, stage)] = tracked
        self._initial: Counter[int] = Counter()
        for action in self._compute_halves(program):
            for param in self._touched.get((action.kind, action.stage), ()):
                self._initial[id(param)] += 1
        untouched = [p for params in stage_params.values() for p in params if not self._initial[id(p)]]
        if untouched:
            raise ScheduleError(f"{len(untouched)} parameters of the local stages get no gradient in this program")
        self._pending: Counter[int] = Counter()

    @staticmethod
    def _compute_halves(program: Sequence[Step]) -> list[Action]:
        return [half for step in program if isinstance(step, Action) for half in step.halves()]

    def start(self) -> None:
        """A new step: every contribution pending again."""
        self._pending = Counter(self._initial)

    def done(self, action: Action) -> list[nn.Parameter]:
        """Record a finished compute action (FB: both halves); returns the parameters it made final."""
        ready = []
        for half in action.halves():
            for param in self._touched.get((half.kind, half.stage), ()):
                self._pending[id(param)] -= 1
                if self._pending[id(param)] == 0:
                    ready.append(param)
        return ready

    def assert_done(self) -> None:
        """End-of-step check: every tracked parameter was released."""
        left = +self._pending
        if left:
            raise ScheduleError(f"{len(left)} parameters still wait for gradient contributions at the end of the step")


def release_positions(program: Sequence[Step], stage_params: Mapping[int, Sequence[nn.Parameter]],
                      split: set[int]) -> dict[int, int]:
    """Parameter id -> index of the step of `program` after which its gradient is final."""
    readiness = GradientReadiness(program, stage_params, split)
    readiness.start()
    return {id(p): i for i, step in enumerate(program) if isinstance(step, Action) for p in readiness.done(step)}
