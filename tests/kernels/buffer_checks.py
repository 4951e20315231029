"""One rank's checks of a per-process `kernels_cuda.Buffer` against the pure-torch reference of all ranks,
on a GPU (tests/gpu/buffer_worker.py, one process per rank on one GPU) or on the CPU emulation
(tests/distributed/test_buffers.py, the gloo worker pool).

Every rank builds the same inputs for all ranks from `seed`, runs its own rank through its buffer and
compares: layout, dispatch, combine, cached dispatch, and the stream API (`previous_event`,
`async_finish`, `allocate_on_comm_stream`) giving the same results as the synchronous calls;
internode also `num_worst_tokens`. Raises AssertionError naming the rank and the step.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from kernels_cuda import Buffer, Config, InternodeConfig, Schedule
from parallel.dispatch.layout import compute_layout
from tests.kernels.cases import payload, routing, weights
from tests.kernels.reference import reference_combine, reference_dispatch

TOKENS, HIDDEN, TOPK = 80, 256, 4


def check_dispatch(result: tuple, want, rank: int, what: str, rows: int | None = None) -> None:
    recv_x, idx, w, per_expert, handle = result[:5]
    rows = want.x.shape[0] if rows is None else rows
    assert torch.equal(recv_x[:rows], want.x), f"rank {rank} {what}: recv_x differs"
    assert torch.equal(handle.recv_src_idx[:rows].long(), want.src_idx), f"rank {rank} {what}: source indices differ"
    assert torch.equal(idx[:rows], want.topk_idx), f"rank {rank} {what}: recv_topk_idx differs"
    assert torch.equal(w[:rows], want.topk_weights), f"rank {rank} {what}: recv_topk_weights differ"
    assert per_expert == want.per_expert, f"rank {rank} {what}: per-expert counts differ"


def rank_inputs(seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(x, topk_idx, topk_weights, num_experts) of this rank, drawn from `seed` as every rank draws all."""
    rank, world = dist.get_rank(), dist.get_world_size()
    experts = 4 * world
    topk = routing("random", world, TOKENS, experts, TOPK, seed=seed, device=device)[rank]
    x = payload("random", world, TOKENS, HIDDEN, torch.bfloat16, seed=seed, device=device)[rank]
    w = weights(world, TOKENS, TOPK, seed=seed, device=device)[rank]
    return x, topk, w, experts


def make_buffer(world: int, gpus_per_node: int, device: str, timeout_cycles: int,
                schedule: Schedule | None = None) -> Buffer:
    nodes = world // gpus_per_node
    if nodes == 1:
        config = Config(num_sms=4, num_max_send_tokens=4, num_max_recv_tokens=16)
    else:
        config = InternodeConfig(num_sms=4, nvl_chunk=2, nvl_capacity=4 * nodes, rdma_chunk=2, rdma_capacity=12)
    nvl, rdma = Buffer.get_buffer_size_hints(nodes, gpus_per_node, HIDDEN * 2, TOPK, config)
    return Buffer(dist.group.WORLD, nvl, rdma, ranks_per_node=gpus_per_node, config=config,
                  timeout_cycles=timeout_cycles, timeout_s=60.0, device=device, schedule=schedule)


def check_buffer(gpus_per_node: int, device: str, seed: int, timeout_cycles: int,
                 schedule: Schedule | None = None) -> str:
    """This rank's checks (the default group is the EP group); returns 'OK rank <r>'."""
    rank, world = dist.get_rank(), dist.get_world_size()
    internode = gpus_per_node != world
    experts = 4 * world
    topk = routing("random", world, TOKENS, experts, TOPK, seed=seed, device=device)
    xs = payload("random", world, TOKENS, HIDDEN, torch.bfloat16, seed=seed, device=device)
    ws = weights(world, TOKENS, TOPK, seed=seed, device=device)
    ref = reference_dispatch(xs, topk, ws, experts)
    want_combined = reference_combine([r.x for r in ref], ref, [TOKENS] * world)[rank]
    buffer = make_buffer(world, gpus_per_node, device, timeout_cycles, schedule)
    assert buffer.is_internode == internode

    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk[rank], experts)
    expect = compute_layout(topk[rank], experts, world, gpus_per_node)
    assert torch.equal(per_rank.long().cpu(), expect.num_tokens_per_rank.long().cpu()), f"rank {rank}: layout per rank"
    assert torch.equal(per_expert.long().cpu(), expect.num_tokens_per_expert.long().cpu()), f"rank {rank}: per expert"
    assert torch.equal(in_rank.cpu(), expect.is_token_in_rank.cpu()), f"rank {rank}: is_token_in_rank"
    if internode:
        assert torch.equal(per_node.long().cpu(), expect.num_tokens_per_node.long().cpu()), f"rank {rank}: per node"
    else:
        assert per_node is None
    layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert)

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
    assert buffer.error_record()["code"] == 0
    buffer.destroy()
    return f"OK rank {rank}"
