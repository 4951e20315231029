"""One rank of the fault test in tests/distributed/test_buffers.py: a per-process CPU `kernels_cuda.Buffer`
dispatching and combining in a loop until a peer is killed. Prints "looping" once the loop runs; a
survivor's buffer op then fails by its kernels' timeout: the error goes to stderr with the buffer's
error record, and the process exits 1.
Usage: python -m tests.distributed.buffer_fault_worker RANK WORLD GPUS_PER_NODE INIT_FILE TIMEOUT_CYCLES
"""
from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tests.kernels.buffer_checks import make_buffer, rank_inputs


def main(rank: int, world: int, gpus_per_node: int, init_file: str, timeout_cycles: int) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    x, topk, w, experts = rank_inputs(5, "cpu")
    buffer = make_buffer(world, gpus_per_node, "cpu", timeout_cycles)
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, experts)
    print("looping", flush=True)
    try:
        while True:
            recv = buffer.dispatch(x, topk_idx=topk, topk_weights=w, num_tokens_per_rank=per_rank,
                                   num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                                   num_tokens_per_expert=per_expert)
            buffer.combine(recv[0], recv[4], topk_weights=recv[2])
    except RuntimeError as error:
        print(f"rank {rank}: {error}\nerror record: {buffer.error_record()}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])))
