"""One rank of the multi-process buffer tests on a GPU (tests/gpu/test_buffer_processes.py): every process
shares the one GPU and runs `tests.kernels.buffer_checks.check_buffer` on its own per-process
`kernels_cuda.Buffer` (intranode when the group is one node, else internode with the RDMA hop over CUDA
IPC). Prints "OK rank <r>" and exits 0, or raises. The same checks run on the CPU emulation in
tests/distributed/test_buffers.py.
Usage: python -m tests.gpu.buffer_worker RANK WORLD GPUS_PER_NODE INIT_FILE
"""
from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tests.kernels.buffer_checks import check_buffer

# Processes on one GPU time-slice rather than run side by side, so spinning kernels get a wide budget.
TIMEOUT_CYCLES = 40_000_000_000


def main(rank: int, world: int, gpus_per_node: int, init_file: str) -> int:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    torch.cuda.set_device(0)
    print(check_buffer(gpus_per_node, "cuda", 21 + world, TIMEOUT_CYCLES), flush=True)
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
