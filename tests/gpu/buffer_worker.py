"""One rank of the multi-process buffer tests (tests/gpu/test_buffer_processes.py).

Every process builds the same inputs for all ranks from fixed seeds, runs its own rank through a real
per-process buffer — `kernels_cuda.Buffer` when the group is one node, else `InternodeBuffer` with
the RDMA hop over CUDA IPC (all processes share this machine) — and compares with the pure-torch
reference of all ranks: layout, dispatch, combine, cached dispatch, and the stream API
(`previous_event`, `async_finish`, `allocate_on_comm_stream`) giving the same results as the
synchronous calls; internode also `num_worst_tokens`. Prints "OK rank <r>" and exits 0, or raises.
Usage: python -m tests.gpu.buffer_worker RANK WORLD GPUS_PER_NODE INIT_FILE
"""
from __future__ import annotations

import dataclasses
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from kernels_cuda import Buffer, Config, InternodeBuffer, InternodeConfig
from parallel.dispatch.layout import compute_layout
from tests.kernels.cases import payload, routing, weights
from tests.kernels.reference import reference_combine, reference_dispatch

TOKENS, HIDDEN, TOPK = 80, 256, 4
# Processes on one GPU time-slice rather than run side by side, so spinning kernels get a wide budget.
TIMEOUT_CYCLES = 40_000_000_000


def check_dispatch(result: tuple, want, rank: int, what: str, rows: int | None = None) -> None:
    recv_x, idx, w, per_expert, handle = result[:5]
    rows = want.x.shape[0] if rows is None else rows
    assert torch.equal(recv_x[:rows], want.x), f"rank {rank} {what}: recv_x differs"
    assert torch.equal(handle.recv_src_idx[:rows].long(), want.src_idx), f"rank {rank} {what}: source indices differ"
    assert torch.equal(idx[:rows], want.topk_idx), f"rank {rank} {what}: recv_topk_idx differs"
    assert torch.equal(w[:rows], want.topk_weights), f"rank {rank} {what}: recv_topk_weights differ"
    assert per_expert == want.per_expert, f"rank {rank} {what}: per-expert counts differ"


def make_buffer(world: int, gpus_per_node: int) -> Buffer | InternodeBuffer:
    if gpus_per_node == world:
        config = Config(num_sms=4, num_max_send_tokens=4, num_max_recv_tokens=16)
        return Buffer(dist.group.WORLD, Buffer.get_nvl_buffer_size_hint(HIDDEN * 2, world, TOPK, config), config,
                      timeout_cycles=TIMEOUT_CYCLES, timeout_s=60.0)
    nodes = world // gpus_per_node
    config = InternodeConfig(num_sms=4, nvl_chunk=2, nvl_capacity=4 * nodes, rdma_chunk=2, rdma_capacity=12)
    rdma, nvl = InternodeBuffer.get_buffer_size_hints(nodes, gpus_per_node, HIDDEN * 2, TOPK, config)
    return InternodeBuffer(dist.group.WORLD, gpus_per_node, nvl, rdma, config, timeout_cycles=TIMEOUT_CYCLES,
                           timeout_s=60.0, rdma_transport="ipc")


def main(rank: int, world: int, gpus_per_node: int, init_file: str) -> int:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    torch.cuda.set_device(0)
    internode = gpus_per_node != world
    experts = 4 * world
    topk = routing("random", world, TOKENS, experts, TOPK, seed=21 + world)
    xs = payload("random", world, TOKENS, HIDDEN, torch.bfloat16, seed=21 + world)
    ws = weights(world, TOKENS, TOPK, seed=21 + world)
    ref = reference_dispatch(xs, topk, ws, experts)
    want_combined = reference_combine([r.x for r in ref], ref, [TOKENS] * world)[rank]
    buffer = make_buffer(world, gpus_per_node)

    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk[rank], experts)
    expect = compute_layout(topk[rank], experts, world, gpus_per_node)
    assert torch.equal(per_rank.long(), expect.num_tokens_per_rank.long()), f"rank {rank}: layout per rank"
    assert torch.equal(per_expert.long(), expect.num_tokens_per_expert.long()), f"rank {rank}: layout per expert"
    assert torch.equal(in_rank, expect.is_token_in_rank), f"rank {rank}: is_token_in_rank"
    if internode:
        assert torch.equal(per_node.long(), expect.num_tokens_per_node.long()), f"rank {rank}: layout per node"
    else:
        assert per_node is None
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    if internode:
        layout["num_tokens_per_rdma_rank"] = per_node

    first = buffer.dispatch(xs[rank], topk_idx=topk[rank], topk_weights=ws[rank], **layout)
    check_dispatch(first, ref[rank], rank, "dispatch")
    combined, combined_w, _ = buffer.combine(first[0], first[4], topk_weights=first[2])
    torch.testing.assert_close(combined.float(), want_combined.float(), rtol=2e-2, atol=2e-2)
    valid = topk[rank] >= 0
    torch.testing.assert_close(combined_w[valid], ws[rank][valid])

    again = buffer.dispatch(xs[rank], handle=first[4])
    assert torch.equal(again[0], first[0]), f"rank {rank}: cached dispatch differs"

    # The stream API: ordered after an event, finished asynchronously, outputs owned by the comm stream.
    before = buffer.capture()
    async_result = buffer.dispatch(xs[rank], topk_idx=topk[rank], topk_weights=ws[rank], previous_event=before,
                                   async_finish=True, allocate_on_comm_stream=True, **layout)
    async_result[5].current_stream_wait()
    check_dispatch(async_result, ref[rank], rank, "async dispatch")
    out, out_w, done = buffer.combine(async_result[0], async_result[4], topk_weights=async_result[2],
                                      async_finish=True)
    with done:  # leaving the block makes the current stream wait for the combine
        pass
    assert torch.equal(out, combined) and torch.equal(out_w, combined_w), f"rank {rank}: async combine differs"

    if internode:
        worst = buffer.dispatch(xs[rank], topk_idx=topk[rank], topk_weights=ws[rank], num_worst_tokens=TOKENS * world,
                                **layout)
        rows = ref[rank].x.shape[0]
        check_dispatch(worst, dataclasses.replace(ref[rank], per_expert=[]), rank, "num_worst_tokens dispatch", rows)
        assert worst[0].shape[0] == TOKENS * world and bool((worst[1][rows:] == -1).all())
        padded_out, _, _ = buffer.combine(worst[0], worst[4], topk_weights=worst[2])
        assert torch.equal(padded_out, combined), f"rank {rank}: combine after num_worst_tokens differs"
        buffer.destroy()
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
