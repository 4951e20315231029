"""Run by test_stalled_rank_ends_in_timeout_diagnostics in its own process (a trap kills the context).

Rank 1's dispatch blocks exit at once, so its peers' receivers wait for channel counts that never
come; they must time out, record what they waited for and trap. Prints the error record and exits 1.
"""
from __future__ import annotations

import sys

import torch

from kernels_cuda import Config, EmulatedGroup
from tests.gpu.cases import payload, routing, weights
from tests.gpu.trap import run_until_trap


def main() -> int:
    num_ranks, experts = 4, 16
    group = EmulatedGroup(num_ranks, 64 << 20, Config(4, 4, 16), timeout_cycles=200_000_000, timeout_s=20.0)
    topk = routing("random", num_ranks, 64, experts, 4, seed=1)
    xs = payload("random", num_ranks, 64, 256, torch.bfloat16, seed=1)
    return run_until_trap(group, lambda: group.dispatch(xs, topk, weights(num_ranks, 64, 4, 1), experts,
                                                        stalled_rank=1))


if __name__ == "__main__":
    sys.exit(main())
