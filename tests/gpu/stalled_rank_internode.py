"""Run by test_internode_emulated's stalled-rank test in its own process (a trap kills the context).

Rank 1 of 2x2 emulated ranks has its dispatch blocks exit at once, so its rail peer's forwarder waits
for RDMA channel meta and its node peer's receivers for NVLink meta that never come; they must time
out, record what they waited for and trap. Prints the error record and exits 1.
"""
from __future__ import annotations

import sys

import torch

from kernels_cuda import EmulatedInternodeGroup, InternodeConfig
from tests.gpu.cases import payload, routing, weights
from tests.gpu.trap import run_until_trap


def main() -> int:
    nodes, gpus, experts = 2, 2, 16
    config = InternodeConfig(num_sms=4, nvl_chunk=2, nvl_capacity=8, rdma_chunk=2, rdma_capacity=12)
    rdma, nvl = config.buffer_size_hints(nodes, gpus, 512, 4)
    group = EmulatedInternodeGroup(nodes, gpus, rdma, nvl, config, timeout_cycles=200_000_000, timeout_s=20.0)
    R = nodes * gpus
    return run_until_trap(group, lambda: group.dispatch(
        payload("random", R, 64, 256, torch.bfloat16, seed=1), routing("random", R, 64, experts, 4, seed=1),
        weights(R, 64, 4, 1), experts, stalled_rank=1))


if __name__ == "__main__":
    sys.exit(main())
