"""The pure-torch `hierarchical` backend (node-limited two hops) on simulated ranks: the oracle of
the internode kernels, with its per-hop byte counters."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.dispatch import HierarchicalDispatcher
from parallel.dispatch.base import COMBINE, DISPATCH, INTER_NODE, INTRA_NODE
from parallel.dispatch.simulated import SimulatedEPGroup


@dataclass
class HierarchicalResult:
    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    per_expert: list[int]
    combined: torch.Tensor
    rows: dict  # (direction, link) -> rows this rank sent over that link


def run_hierarchical(num_nodes: int, gpus_per_node: int, xs: list[torch.Tensor], topk_idx: list[torch.Tensor],
                     topk_weights: list[torch.Tensor], num_experts: int, combine_inputs) -> list[HierarchicalResult]:
    """Dispatch, then combine `combine_inputs(rank, recv_x)`, on every rank of the simulated group."""

    def step(rank: int, comms) -> HierarchicalResult:
        d = HierarchicalDispatcher(comms.intra_node, comms.rail, num_experts)
        with torch.no_grad():
            recv_x, local, recv_w, counts, plan = d.dispatch(xs[rank], topk_idx[rank], topk_weights[rank],
                                                             d.layout(topk_idx[rank], num_experts))
            combined = d.combine(combine_inputs(rank, recv_x), plan)
        return HierarchicalResult(recv_x, local, recv_w, counts, combined, dict(d.traffic.rows))

    return SimulatedEPGroup(num_nodes * gpus_per_node, gpus_per_node).run(step)


def kernel_hop_rows(num_nodes: int, gpus_per_node: int, handles) -> list[dict]:
    """Per rank, the rows each hop of the kernels moved to other ranks, keyed like `Traffic.rows`:
    RDMA records (one per token and destination node), NVLink copies (one per record and GPU bit),
    and the same hops backwards in combine. Read from the handles before combine rewrites them."""
    G = gpus_per_node
    out = []
    for rank, h in enumerate(handles):
        node, gpu = divmod(rank, G)
        other_nodes = [m for m in range(num_nodes) if m != node]
        other_gpus = [j for j in range(G) if j != gpu]
        rdma_prefix = h.recv_rdma_rank_prefix_sum.long()
        rdma_from = torch.diff(rdma_prefix, prepend=rdma_prefix.new_zeros(1))
        rows_prefix = h.recv_gbl_rank_prefix_sum.long()
        rows_from = torch.diff(rows_prefix, prepend=rows_prefix.new_zeros(1))
        rows = {
            (DISPATCH, INTER_NODE): int((h.send_rdma_head[:, other_nodes] >= 0).sum()),
            (DISPATCH, INTRA_NODE): int((h.send_nvl_head[:, other_gpus] >= 0).sum()),
            (COMBINE, INTER_NODE): int(rdma_from[other_nodes].sum()),
            (COMBINE, INTRA_NODE): int(sum(rows_from[s] for s in range(num_nodes * G) if s % G != gpu)),
        }
        out.append({k: v for k, v in rows.items() if v})
    return out
