"""Ops that end in a device trap, for the kernel tests. On the CPU emulation a trap fails the launch
and the process lives on, so they run in the test's own process; on a GPU a trap kills the context, so
each runs in a process of its own: `python -m tests.kernels.traps NAME` prints the group's error
record as `ERROR_RECORD key=value ...` and exits 1 when one was recorded."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from kernels_cuda import Config, EmulatedGroup, EmulatedInternodeGroup, InternodeConfig
from tests.kernels.cases import payload, routing, weights
from tests.kernels.runs import Run

Trap = Callable[[Run], tuple[Any, Callable[[], Any]]]  # run -> (group, the launch that traps)


def intranode_stall(run: Run):
    """Rank 1's dispatch blocks exit at once: its peers wait for counts and room that never come."""
    R, E, T = 4, 16, 64
    group = EmulatedGroup(R, 64 << 20, Config(4, 4, 16), timeout_cycles=200_000_000, timeout_s=20.0,
                          **run.group_kwargs())
    topk, xs = routing("random", R, T, E, 4, seed=1, device=run.device), payload(
        "random", R, T, 256, torch.bfloat16, seed=1, device=run.device)
    ws = weights(R, T, 4, 1, device=run.device)
    return group, lambda: group.dispatch(xs, topk, ws, E, stalled_rank=1)


def intranode_worst_tokens_overflow(run: Run):
    """num_worst_tokens smaller than what rank 3 receives (every token goes to the last rank): code 2."""
    R, E, T = 4, 16, 64
    group = EmulatedGroup(R, 64 << 20, Config(4, 4, 16), timeout_cycles=2_000_000_000, timeout_s=20.0,
                          **run.group_kwargs())
    topk = routing("all_to_one_rank", R, T, E, 4, seed=2, device=run.device)
    xs, ws = payload("random", R, T, 256, torch.bfloat16, seed=2, device=run.device), weights(R, T, 4, 2, device=run.device)
    return group, lambda: group.dispatch(xs, topk, ws, E, num_worst_tokens=T // 2)


def _internode_group(run: Run, timeout_cycles: int) -> EmulatedInternodeGroup:
    """2 x 2 ranks with small rings."""
    config = InternodeConfig(num_sms=4, nvl_chunk=2, nvl_capacity=8, rdma_chunk=2, rdma_capacity=12)
    rdma, nvl = config.buffer_size_hints(2, 2, 512, 4)
    return EmulatedInternodeGroup(2, 2, rdma, nvl, config, timeout_cycles=timeout_cycles, timeout_s=20.0,
                                  **run.group_kwargs())


def internode_stall(run: Run):
    """2 x 2 ranks, rank 1's blocks exit at once."""
    R, E, T = 4, 16, 64
    group = _internode_group(run, 200_000_000)
    xs, topk = payload("random", R, T, 256, torch.bfloat16, seed=1, device=run.device), routing(
        "random", R, T, E, 4, seed=1, device=run.device)
    ws = weights(R, T, 4, 1, device=run.device)
    return group, lambda: group.dispatch(xs, topk, ws, E, stalled_rank=1)


def internode_worst_tokens_overflow(run: Run):
    """2 x 2 ranks, every token to the last rank, num_worst_tokens half of what it receives: code 2."""
    R, E, T = 4, 16, 64
    group = _internode_group(run, 2_000_000_000)
    topk = routing("all_to_one_rank", R, T, E, 4, seed=2, device=run.device)
    xs, ws = payload("random", R, T, 256, torch.bfloat16, seed=2, device=run.device), weights(R, T, 4, 2, device=run.device)
    return group, lambda: group.dispatch(xs, topk, ws, E, num_worst_tokens=T // 2)


TRAPS: dict[str, Trap] = {f.__name__: f for f in (intranode_stall, intranode_worst_tokens_overflow, internode_stall,
                                                  internode_worst_tokens_overflow)}


def run_trap(trap: Trap, run: Run) -> tuple[dict, str]:
    """(the group's error record, the output or error text) after the trapping op."""
    if run.device == "cpu":
        group, launch = trap(run)
        try:
            launch()
        except RuntimeError as error:
            return group.error_record(), str(error)
        raise AssertionError(f"{trap.__name__} did not fail")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.traps", trap.__name__], capture_output=True,
                          text=True, timeout=120, env=env)
    output = proc.stdout + proc.stderr
    line = next((l for l in output.splitlines() if l.startswith("ERROR_RECORD ")), "")
    record = {}
    for item in line.split()[1:]:
        key, value = item.split("=", 1)
        record[key] = int(value) if value.lstrip("-").isdigit() else value
    assert proc.returncode != 0 and record, output
    return record, output


def main(name: str) -> int:
    group, launch = TRAPS[name](Run("cuda"))
    try:
        launch()
        torch.cuda.synchronize()
    except RuntimeError as error:
        print(f"failed as expected: {error}")
    record = group.error_record()
    print("ERROR_RECORD " + " ".join(f"{k}={v}" for k, v in record.items()), flush=True)
    return 1 if record["code"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
