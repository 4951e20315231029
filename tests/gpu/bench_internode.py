"""Emulated internode (2 nodes x 4 GPUs) dispatch/combine throughput with DeepSeek-V3-like node-limited
routing, against a device-to-device copy of the same logical bytes measured in the same run, and
against the intranode kernels moving the same tokens among 8 ranks of one node. Prints ratios and
the per-hop record counts (how node-limited routing shows in the data); asserts nothing about timing.

Run: python -m tests.gpu.bench_internode
"""
from __future__ import annotations

import torch

from kernels_cuda import Config, EmulatedGroup, EmulatedInternodeGroup, InternodeConfig
from parallel.dispatch.base import DISPATCH, INTER_NODE, INTRA_NODE
from tests.gpu.bench_emulated import _time_ms
from tests.kernels.cases import node_limited_routing, payload, weights
from tests.kernels.reference_internode import kernel_hop_rows


def main() -> None:
    nodes, gpus, tokens, hidden, topk_k, experts = 2, 4, 4096, 7168, 8, 256
    ranks = nodes * gpus
    # 8 ranks x 8 channels x 2 blocks = 128 co-resident blocks fit the 132 SMs of an H200.
    config = InternodeConfig(num_sms=16)
    rdma, nvl = config.buffer_size_hints(nodes, gpus, hidden * 2, topk_k)
    group = EmulatedInternodeGroup(nodes, gpus, rdma, nvl, config)
    topk = node_limited_routing(nodes, gpus, tokens, experts, topk_k, max_nodes=1, seed=0)
    xs = payload("random", ranks, tokens, hidden, torch.bfloat16, seed=0)
    ws = weights(ranks, tokens, topk_k, 0)
    results = group.dispatch(xs, topk, ws, experts)
    handles = [r[4] for r in results]
    hops = kernel_hop_rows(nodes, gpus, handles)
    rows = sum(r[0].shape[0] for r in results)
    nbytes = rows * hidden * 2
    rdma_records = sum(h.get((DISPATCH, INTER_NODE), 0) for h in hops)
    nvl_copies = sum(h.get((DISPATCH, INTRA_NODE), 0) for h in hops)
    ys = [r[0] for r in results]

    dispatch_ms = _time_ms(lambda: group.dispatch(xs, topk, ws, experts))
    cached_ms = _time_ms(lambda: group.dispatch(xs, handles=handles))
    combine_ms = _time_ms(lambda: group.combine(ys, handles))

    intra_config = Config(num_sms=16, num_max_send_tokens=6, num_max_recv_tokens=256)
    intra = EmulatedGroup(ranks, intra_config.buffer_size_hint(ranks, hidden * 2, topk_k), intra_config)
    intra_ms = _time_ms(lambda: intra.dispatch(xs, topk, ws, experts))
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda: dst.copy_(src))

    def gbps(ms: float) -> float:
        return nbytes / ms / 1e6

    print(f"emulated internode {nodes}x{gpus}, {tokens} tokens/rank, H={hidden}, top-{topk_k} within 1 node, "
          f"{rows} rows ({nbytes / 2**20:.0f} MiB logical), config {config}")
    print(f"records: {rdma_records} RDMA (one per token and other node), {nvl_copies} NVLink copies to other GPUs")
    print(f"d2d copy               {copy_ms:8.3f} ms  {gbps(copy_ms):8.1f} GB/s")
    for name, ms in (("dispatch (+notify)", dispatch_ms), ("dispatch cached", cached_ms), ("combine", combine_ms),
                     ("intranode dispatch x8", intra_ms)):
        print(f"{name:22} {ms:8.3f} ms  {gbps(ms):8.1f} GB/s  ratio to copy {copy_ms / ms:.3f}")
    print(f"internode / intranode dispatch time: {dispatch_ms / intra_ms:.2f}")


if __name__ == "__main__":
    main()
