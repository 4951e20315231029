"""Run by test_num_worst_tokens_too_small_traps_with_a_record in its own process (a trap kills the
context): dispatch with num_worst_tokens smaller than what rank 3 receives must record code 2
(rows, limit) and trap before writing past the outputs. Prints the error record and exits 1."""
from __future__ import annotations

import sys

import torch

from kernels_cuda import Config, EmulatedGroup
from tests.gpu.cases import payload, routing, weights
from tests.gpu.trap import run_until_trap


def main() -> int:
    num_ranks, experts, tokens = 4, 16, 64
    group = EmulatedGroup(num_ranks, 64 << 20, Config(4, 4, 16), timeout_cycles=2_000_000_000, timeout_s=20.0)
    topk = routing("all_to_one_rank", num_ranks, tokens, experts, 4, seed=2)  # the last rank receives them all
    xs = payload("random", num_ranks, tokens, 256, torch.bfloat16, seed=2)
    return run_until_trap(group, lambda: group.dispatch(xs, topk, weights(num_ranks, tokens, 4, 2), experts,
                                                        num_worst_tokens=tokens // 2))


if __name__ == "__main__":
    sys.exit(main())
