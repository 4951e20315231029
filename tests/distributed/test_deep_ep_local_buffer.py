"""`deep_ep.Buffer.get_local_buffer_tensor` (kernels_cuda.deep_ep) on per-process buffers of the CPU
emulation: a view of the memory the kernels use, as DeepEP's, both ways.

- The kernels' writes show through the view: after a dispatch, the count rows the notify kernels put
  into this rank's buffer (our layout: csrc/params/config.h BufferLayout::notify_rank intranode;
  params/internode_layout.h NvlLayout::notify and RdmaLayout::notify internode, each at byte 128, read with DeepEP's
  byte `offset` and `size`) equal the counts of every rank's routing.
- Writes through the view reach the kernels: the low-latency combine's zero-copy input written through
  a view of the RDMA buffer (the low-latency region) is what `low_latency_combine(zero_copy=True)` sums.
- Bounds and missing buffers are refused naming the argument; a destroyed buffer has no view.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kernels_cuda import Schedule
from kernels_cuda import constants as C
from kernels_cuda.config import NVL_NOTIFY_INTS, RDMA_NOTIFY_INTS, align_up
from tests.kernels.deep_ep_alias import deep_ep_installed

TOKENS, HIDDEN, TOPK, EXPERTS_PER_RANK = 16, 128, 3, 2
TIMEOUT_CYCLES = 60_000_000_000  # 30 s of wall clock: processes time-slice 2 cores
NOTIFY_OFFSET = align_up(C.MAX_RANKS * 4, C.BUFFER_ALIGN)  # = align_up(kMaxNvlPeers/kMaxRdmaPeers * 4, ...): 128
assert NOTIFY_OFFSET == align_up(C.MAX_NVL_PEERS * 4, C.BUFFER_ALIGN) == align_up(C.MAX_RDMA_PEERS * 4, C.BUFFER_ALIGN)


def _schedule(seed: int) -> Schedule:
    schedule = Schedule("random", seed * 16 + dist.get_rank())
    print(f"rank {dist.get_rank()}: schedule {schedule}")
    return schedule


def _routing(world: int, seed: int) -> list[torch.Tensor]:
    """Every rank's topk_idx (each process draws all of them)."""
    print(f"rank {dist.get_rank()}: routing seed {seed}")
    g = torch.Generator().manual_seed(seed)
    experts = EXPERTS_PER_RANK * world
    return [torch.stack([torch.randperm(experts, generator=g)[:TOPK] for _ in range(TOKENS)]) for _ in range(world)]


def _tokens_per_rank(topk_idx: torch.Tensor, world: int) -> torch.Tensor:
    ranks = topk_idx // EXPERTS_PER_RANK
    return torch.stack([(ranks == d).any(1).sum() for d in range(world)]).int()


def notify_rows_rank(nvl_peers: int, seed: int) -> str:
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    routing = _routing(world, seed)
    sent = torch.stack([_tokens_per_rank(idx, world) for idx in routing])  # [source, destination]
    with deep_ep_installed(nvl_peers) as deep_ep:
        deep_ep.Buffer.set_num_sms(2)
        config = deep_ep.Buffer.get_dispatch_config(world)
        nvl = config.get_nvl_buffer_size_hint(HIDDEN * 2, world)
        rdma = config.get_rdma_buffer_size_hint(HIDDEN * 2, world)
        buffer = deep_ep.Buffer(group, nvl, rdma, explicitly_destroy=True, device="cpu", schedule=_schedule(seed),
                                timeout_cycles=TIMEOUT_CYCLES)
        whole = buffer.get_local_buffer_tensor(torch.uint8)
        assert whole.numel() == nvl and whole.device.type == "cpu"
        assert buffer.get_local_buffer_tensor(torch.int64).numel() == nvl // 8
        per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(routing[rank], EXPERTS_PER_RANK * world)
        buffer.dispatch(torch.randn(TOKENS, HIDDEN).bfloat16(), num_tokens_per_rank=per_rank,
                        num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        config=config)
        if world <= nvl_peers:  # one node: row s of notify_rank = what rank s sends to each rank
            rows = buffer.get_local_buffer_tensor(torch.int32, torch.Size([C.MAX_RANKS, C.MAX_RANKS]), NOTIFY_OFFSET)
            assert torch.equal(rows[:world, :world], sent), f"rank {rank}: notify rows {rows[:world, :world]}"
            with pytest.raises(ValueError, match="no RDMA buffer"):
                buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
        else:
            node, gpu = divmod(rank, nvl_peers)
            nodes = world // nvl_peers
            # NVLink notify, row g (from forwarder g of this node), column n: what rank (n, g) sends to this rank
            rows = buffer.get_local_buffer_tensor(torch.int32, (C.MAX_NVL_PEERS, NVL_NOTIFY_INTS), NOTIFY_OFFSET)
            want = torch.stack([sent[torch.arange(nodes) * nvl_peers + g, rank] for g in range(nvl_peers)])
            assert torch.equal(rows[:nvl_peers, :nodes], want), f"rank {rank}: NVLink notify rows"
            # RDMA notify, row n (from rail peer (n, gpu)): what it sends to each GPU of this node
            rows = buffer.get_local_buffer_tensor(torch.int32, (C.MAX_RDMA_PEERS, RDMA_NOTIFY_INTS), NOTIFY_OFFSET,
                                                  use_rdma_buffer=True)
            want = sent[torch.arange(nodes) * nvl_peers + gpu][:, node * nvl_peers:(node + 1) * nvl_peers]
            assert torch.equal(rows[:nodes, :nvl_peers], want), f"rank {rank}: RDMA notify rows"
            assert buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True).numel() == rdma
        with pytest.raises(ValueError, match="offset must be a multiple of the 4-byte size of torch.int32"):
            buffer.get_local_buffer_tensor(torch.int32, offset=NOTIFY_OFFSET + 2)
        with pytest.raises(ValueError, match=r"size \[.*\] needs"):
            buffer.get_local_buffer_tensor(torch.int32, (nvl // 4 + 1,))
        with pytest.raises(ValueError, match=r"offset must be a byte offset in \[0, "):
            buffer.get_local_buffer_tensor(torch.uint8, offset=nvl + 1)
        buffer.destroy()
        with pytest.raises(RuntimeError, match="destroyed|not mapped"):
            buffer.get_local_buffer_tensor(torch.uint8)
    return "ok"


def zero_copy_through_the_view_rank(seed: int) -> str:
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    experts, max_tokens = EXPERTS_PER_RANK * world, TOKENS
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    topk_idx = _routing(world, seed)[rank]
    topk_weights = torch.rand(TOKENS, TOPK, generator=g)
    with deep_ep_installed(8) as deep_ep:
        size = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, HIDDEN, world, experts)
        buffer = deep_ep.Buffer(group, 0, size, low_latency_mode=True, explicitly_destroy=True, device="cpu",
                                schedule=_schedule(seed), timeout_cycles=TIMEOUT_CYCLES)
        with pytest.raises(ValueError, match=r"no NVLink buffer \(num_nvl_bytes=0\)"):
            buffer.get_local_buffer_tensor(torch.uint8)
        region = buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
        assert region.numel() == size
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, max_tokens, experts, use_fp8=False)
        zero_copy = buffer.get_next_low_latency_combine_buffer(handle)
        offset = zero_copy.data_ptr() - region.data_ptr()  # where our layout keeps the zero-copy input
        assert 0 < offset and offset + zero_copy.numel() * 2 <= size
        view = buffer.get_local_buffer_tensor(torch.bfloat16, zero_copy.shape, offset, use_rdma_buffer=True)
        assert view.data_ptr() == zero_copy.data_ptr()
        view.zero_()
        view[:] = recv_x  # the experts' outputs: the received rows themselves (unused slots: whatever they hold)
        assert torch.equal(zero_copy.view(torch.int16), recv_x.view(torch.int16)), f"rank {rank}: write lost"
        combined, _, _ = buffer.low_latency_combine(torch.empty(0), topk_idx, topk_weights, handle, zero_copy=True)
        want = x.float() * topk_weights.sum(1, keepdim=True)
        torch.testing.assert_close(combined.float(), want, rtol=2e-2, atol=2e-2)
        buffer.destroy()
    return "ok"


@pytest.mark.parametrize("world, nvl_peers", [(4, 8), (4, 2)], ids=["intranode-4", "internode-2x2"])
def test_local_buffer_views_show_what_the_notify_kernels_wrote(pools, kernels_cpu, world, nvl_peers):
    assert pools.get(world).run(notify_rows_rank, nvl_peers, 61, deadline_s=120) == ["ok"] * world


def test_writes_through_the_rdma_view_are_what_the_zero_copy_combine_reads(pools, kernels_cpu):
    assert pools.get(4).run(zero_copy_through_the_view_rank, 62, deadline_s=120) == ["ok"] * 4
