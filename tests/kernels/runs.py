"""Where and under which schedules the kernel tests run.

Every case runs on the CPU emulation under several scheduler seeds (PCT with varied depth and
horizon, and uniform random, alternating; at least `count` per case family), plus `relaxed` runs
under the relaxed memory mode (Schedule.memory, docs/kernels_emulation.md), and once on CUDA where a
GPU and the CUDA build are present. KERNELS_CUDA_SOAK=N runs N seeds per case instead (the opt-in
soak); KERNELS_CPU_MEMORY=relaxed runs every CPU seed in the relaxed memory mode. A failing run's id
and the emulator's error both name the schedule, seed and memory mode that replay it.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, replace
from typing import Any, Sequence

import pytest

from kernels_cuda import Schedule

SOAK = int(os.environ.get("KERNELS_CUDA_SOAK", "0"))
MEMORY = os.environ.get("KERNELS_CPU_MEMORY", "sequential")
RELAXED_RUNS = 3  # relaxed-memory runs per case family when the others are sequential


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
        memory = "-relaxed" if s.memory == "relaxed" else ""
        return f"{self.device}-{s.policy}{extra}-seed{s.seed}{memory}"

    def group_kwargs(self) -> dict[str, Any]:
        return {"device": self.device, "schedule": self.schedule}


def cpu_schedules(count: int, family: int, memory: str = MEMORY) -> list[Schedule]:
    """`count` schedules, alternating PCT and random, seeds distinct per case family."""
    out = []
    for i in range(count):
        seed = family * 1_000_003 + i
        if i % 2 == 0:
            out.append(Schedule("pct", seed, pct_depth=2 + (i // 2) % 5, pct_steps=1 << (12 + (i // 2) % 7), memory=memory))
        else:
            out.append(Schedule("random", seed, memory=memory))
    return out


def cases(configs: Sequence[Any], count: int, family: int, relaxed: int = RELAXED_RUNS) -> list[Any]:
    """pytest params (config, run): the configs cycle over at least `count` CPU schedules (SOAK if set;
    every config at least once), then over `relaxed` of them again in the relaxed memory mode (unless
    KERNELS_CPU_MEMORY made them all relaxed), then every config once on CUDA."""
    schedules = cpu_schedules(SOAK or max(count, len(configs)), family)
    if MEMORY != "relaxed":
        schedules += [replace(s, memory="relaxed") for s in schedules[:relaxed]]
    cycle = itertools.cycle(configs)
    params = [pytest.param(next(cycle), Run("cpu", s), id=f"{i}-{Run('cpu', s).id}") for i, s in enumerate(schedules)]
    params += [pytest.param(c, Run("cuda"), id=f"{i}-cuda") for i, c in enumerate(configs)]
    return params
