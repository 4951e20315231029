"""Where and under which schedules the kernel tests run.

Every case runs on the CPU emulation under several scheduler seeds (PCT with varied depth and
horizon, and uniform random, alternating; at least `count` per case family), and once on CUDA where a
GPU and the CUDA build are present. KERNELS_CUDA_SOAK=N runs N seeds per case instead (the opt-in
soak). A failing run's id and the emulator's error both name the schedule and seed that replay it.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any, Sequence

import pytest

from kernels_cuda import Schedule

SOAK = int(os.environ.get("KERNELS_CUDA_SOAK", "0"))


@dataclass(frozen=True)
class Run:
    device: str
    schedule: Schedule | None = None

    @property
    def id(self) -> str:
        if self.schedule is None:
            return self.device
        s = self.schedule
        extra = f"d{s.pct_depth}h{s.pct_steps}" if s.policy == "pct" else ""
        return f"{self.device}-{s.policy}{extra}-seed{s.seed}"

    def group_kwargs(self) -> dict[str, Any]:
        return {"device": self.device, "schedule": self.schedule}


def cpu_schedules(count: int, family: int) -> list[Schedule]:
    """`count` schedules (SOAK if set), alternating PCT and random, seeds distinct per case family."""
    out = []
    for i in range(SOAK or count):
        seed = family * 1_000_003 + i
        if i % 2 == 0:
            out.append(Schedule("pct", seed, pct_depth=2 + (i // 2) % 5, pct_steps=1 << (12 + (i // 2) % 7)))
        else:
            out.append(Schedule("random", seed))
    return out


def cases(configs: Sequence[Any], count: int, family: int) -> list[Any]:
    """pytest params (config, run): the configs cycle over at least `count` CPU schedules (every config at
    least once), then every config once on CUDA."""
    schedules = cpu_schedules(max(count, len(configs)), family)
    cycle = itertools.cycle(configs)
    params = [pytest.param(next(cycle), Run("cpu", s), id=f"{i}-{Run('cpu', s).id}") for i, s in enumerate(schedules)]
    params += [pytest.param(c, Run("cuda"), id=f"{i}-cuda") for i, c in enumerate(configs)]
    return params
