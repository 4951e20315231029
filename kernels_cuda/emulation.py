"""Where an emulated group's kernels run, and how the CPU emulation schedules them.

`Schedule` is the CPU emulation's scheduler setting (csrc/emu/emulator.h): at every atomic, acquire
load, release store, fence, clock read, __nanosleep, barrier and warp collective a kernel's fibers
may switch, and the policy picks which runs next: "round_robin" (each in turn), "random" (uniform
over the runnable ones) or "pct" (random priorities with `pct_depth - 1` change points in the first
`pct_steps` switch points; a spinning fiber drops to the lowest priority). Each launch of a group
draws its own interleaving from (seed, launch index), so a seed replays a whole sequence of ops, and
a failed launch's error names its schedule and seed. `sm_count` is the emulated device's SMs: a
cooperative grid larger than that is refused, as on a GPU. `memory` is the memory model: "sequential"
(every store seen by every thread at once) or "relaxed" (a plain store to memory other threads read
stays pending, seen by its thread only, until a barrier, a release or its thread's exit makes it
visible, as PTX allows: docs/kernels_emulation.md); "relaxed" needs every rank of a group in one
process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels_cuda.extensions import default_device

POLICIES = ("round_robin", "random", "pct")
MEMORY_MODES = ("sequential", "relaxed")
H200_SMS = 132


@dataclass(frozen=True)
class Schedule:
    policy: str = "round_robin"
    seed: int = 0
    pct_depth: int = 3
    pct_steps: int = 1 << 20
    sm_count: int = H200_SMS
    memory: str = "sequential"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"Schedule.policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"Schedule.memory must be one of {', '.join(MEMORY_MODES)}, got {self.memory!r}")
        if self.pct_depth < 1 or self.pct_steps < 1 or self.sm_count < 1 or self.seed < 0:
            raise ValueError(f"Schedule: pct_depth, pct_steps and sm_count must be >= 1 and seed >= 0: {self}")

    def apply(self, runtime: Any) -> None:
        """Makes `runtime` (a _C_cpu runtime) launch under this schedule from now on."""
        runtime.set_schedule(self.policy, self.seed, self.pct_depth, self.pct_steps, self.sm_count, self.memory)


def resolve_device(device: str | None) -> str:
    """The device an emulated group runs on: as given, else kernels_cuda.default_device()."""
    return default_device() if device is None else device


def apply_schedule(runtime: Any, device: str, schedule: Schedule | None) -> None:
    """The CPU emulation's runtime launches under `schedule` (default Schedule()); a GPU takes none."""
    if device == "cpu":
        (schedule or Schedule()).apply(runtime)
    elif schedule is not None:
        raise ValueError("kernels_cuda: a Schedule applies to the CPU emulation (device='cpu') only")


def device_sms(device: str, schedule: Schedule | None) -> int:
    """SMs a cooperative grid may occupy: the GPU's, or the emulation's `sm_count`."""
    if device == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return (schedule or Schedule()).sm_count


def check_resident(what: str, blocks: int, sms: int, fix: str) -> None:
    """A cooperative launch needs every block resident at once (one per SM): refuse a larger grid."""
    if blocks > sms:
        raise ValueError(f"kernels_cuda: {what} needs a cooperative grid of {blocks} blocks, but the device has "
                         f"{sms} SMs; {fix}")
