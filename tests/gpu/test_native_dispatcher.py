"""The `native` dispatcher on emulated ranks (one GPU, one thread per rank through
`kernels_cuda.rank_views`) against the pure-torch backends: intranode against `alltoall`, internode
(nodes x GPUs, two-hop kernels) against `hierarchical`; outputs, both gradients, the cached dispatch
of combine's backward, and the byte counters per link and direction."""
from __future__ import annotations

import pytest
import torch

from kernels_cuda import Config, EmulatedGroup, EmulatedInternodeGroup, InternodeConfig
from kernels_cuda.rank_views import rank_views
from parallel.dispatch import AllToAllDispatcher, HierarchicalDispatcher, NativeDispatcher
from parallel.dispatch.native import BufferSizes
from parallel.dispatch.simulated import SimulatedEPGroup

N, H, K = 64, 256, 4
CONFIG = Config(num_sms=4, num_max_send_tokens=4, num_max_recv_tokens=16)
TIMEOUT_CYCLES = 4_000_000_000  # ~2 s: a hang fails fast with diagnostics
DTYPES = [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]


def small_internode_config(num_nodes: int) -> InternodeConfig:
    """Small rings (many wrap-arounds) that still meet the two-hop protocol's conditions."""
    return InternodeConfig(num_sms=4, nvl_chunk=2, nvl_capacity=4 * num_nodes, rdma_chunk=2, rdma_capacity=12)


def _inputs(rank: int, num_experts: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(N, H, generator=g).to(dtype).cuda().requires_grad_()
    w = torch.rand(N, K, generator=g).cuda().requires_grad_()
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:K] for _ in range(N)])
    idx[torch.rand(N, K, generator=g) < 0.15] = -1
    return x, w, idx.cuda()


def _step(d, rank: int, num_experts: int, dtype: torch.dtype):
    x, w, idx = _inputs(rank, num_experts, dtype)
    recv_x, recv_idx, recv_w, counts, handle = d.dispatch(x, idx, w, d.layout(idx, num_experts))
    scale = (recv_w * (recv_idx + 2)).sum(1, keepdim=True).to(recv_x.dtype)
    out = d.combine(recv_x * scale, handle)
    (out.float() * torch.arange(H, device="cuda").float()).sum().backward()
    torch.cuda.synchronize()
    return [recv_x.detach(), recv_idx, recv_w.detach(), counts, out.detach(), x.grad, w.grad,
            dict(d.traffic.rows), dict(d.traffic.bytes)]


def _compare(native: list, reference: list) -> None:
    names = ["recv_x", "recv_idx", "recv_w", "counts", "combined", "x.grad", "w.grad", "rows", "bytes"]
    exact = {"recv_x", "recv_idx", "recv_w", "rows", "bytes"}
    for rank, (got, want) in enumerate(zip(native, reference)):
        for name, a, b in zip(names, got, want):
            if isinstance(a, dict):
                assert a == b, f"rank {rank}: traffic {name}"
            elif isinstance(a, list):  # the received slots per expert, a host list
                assert a == b, f"rank {rank}: {name}"
            elif name in exact:
                assert torch.equal(a, b), f"rank {rank}: {name}"
            else:  # sums: the kernels accumulate in fp32 in rank order, as the reference does, up to rounding
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=f"rank {rank}: {name}")


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("dtype,fp8", DTYPES)
def test_native_matches_alltoall(num_ranks, dtype, fp8):
    experts = 4 * num_ranks
    group = EmulatedGroup(num_ranks, 64 << 20, CONFIG, timeout_cycles=TIMEOUT_CYCLES, timeout_s=20.0)
    views = rank_views(group, num_ranks, timeout_s=60)
    sim = SimulatedEPGroup(num_ranks, num_ranks)
    native = sim.run(lambda r, _c: _step(NativeDispatcher(lambda _b: views[r], experts, num_ranks, r, num_ranks,
                                                          fp8, CONFIG), r, experts, dtype))
    reference = SimulatedEPGroup(num_ranks, num_ranks).run(
        lambda r, comms: _step(AllToAllDispatcher(comms.ep, experts, num_ranks, fp8), r, experts, dtype))
    _compare(native, reference)


@pytest.mark.parametrize("nodes,gpus", [(2, 2), (2, 4)])
@pytest.mark.parametrize("dtype,fp8", DTYPES)
def test_native_internode_matches_hierarchical(nodes, gpus, dtype, fp8):
    num_ranks, experts = nodes * gpus, 4 * nodes * gpus
    config = small_internode_config(nodes)
    rdma, nvl = config.buffer_size_hints(nodes, gpus, 4 * H, K)  # room for float32 rows
    group = EmulatedInternodeGroup(nodes, gpus, rdma, nvl, config, timeout_cycles=TIMEOUT_CYCLES, timeout_s=20.0)
    views = rank_views(group, num_ranks, timeout_s=60)

    def native_step(rank, _comms):
        def factory(sizes):
            assert BufferSizes(nvl, rdma).covers(sizes), f"the emulated group is smaller than {sizes}"
            return views[rank]

        return _step(NativeDispatcher(factory, experts, num_ranks, rank, gpus, fp8, config), rank, experts, dtype)

    native = SimulatedEPGroup(num_ranks, gpus).run(native_step)
    reference = SimulatedEPGroup(num_ranks, gpus).run(lambda r, comms: _step(
        HierarchicalDispatcher(comms.intra_node, comms.rail, experts, fp8), r, experts, dtype))
    _compare(native, reference)
