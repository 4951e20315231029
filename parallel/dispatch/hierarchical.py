"""Node-limited two-hop dispatch over torch.distributed (DeepEP's internode path, without kernels).

Rank (node n, local rank l) of an EP group with L ranks per node:
1. inter-node hop, on the rail group: one record per (token, destination node m) goes to the
   same-local-rank peer (m, l), however many ranks of node m the token needs;
2. intra-node hop, on the intra-node group: that forwarder fans each record out to the ranks
   (m, j) of its node that own one of the token's experts.
A receiver gets source rank (m', l')'s rows through forwarder l', so its rows arrive grouped by
(forwarder, source node); a final stable sort by source rank gives the contract's order. Combine
runs the hops backwards: each forwarder sums the rows of one record before the single send back
to the token's node, so a token crosses the network once per destination node in both directions.
"""
from __future__ import annotations

import torch

from model.dispatcher import Layout, count_per_expert
from parallel.dispatch.base import DISPATCH, INTER_NODE, INTRA_NODE, ExchangeDispatcher, Plan, make_hop
from parallel.dispatch.comm import Comm
from parallel.dispatch.layout import to_local_expert_ids, token_in_rank


class HierarchicalDispatcher(ExchangeDispatcher):
    """Two hops: rail group across nodes (one record per destination node), then intra-node fan-out."""

    def __init__(self, intra_node: Comm, rail: Comm, num_experts: int, fp8: bool = False) -> None:
        per_node = intra_node.size
        super().__init__(num_experts, rail.size * per_node, rail.rank * per_node + intra_node.rank, per_node, fp8)
        self.intra, self.rail = intra_node, rail
        self.node, self.local_rank = rail.rank, intra_node.rank
        self.rail_links = [None if m == self.node else INTER_NODE for m in range(rail.size)]
        self.intra_links = [None if j == self.local_rank else INTRA_NODE for j in range(per_node)]

    def route(self, fields: list[torch.Tensor], layout: Layout) -> tuple[list[torch.Tensor], Plan, list[int]]:
        per_node, nodes, experts_per_rank = self.ranks_per_node, self.rail.size, self.experts_per_rank
        to_node = layout.is_token_in_rank.view(-1, nodes, per_node).any(-1)
        rail_hop, from_nodes, _ = make_hop(self.rail, to_node, self.rail_links)
        forwarded = rail_hop.forward(fields, self.traffic, DISPATCH)

        global_idx = forwarded[-2].long()
        first = self.node * per_node
        to_rank = token_in_rank(global_idx, experts_per_rank, self.num_ranks)[:, first:first + per_node]
        source_node = torch.repeat_interleave(torch.arange(nodes, device=global_idx.device), from_nodes[:, 0],
                                              output_size=global_idx.shape[0])
        per_source_node = torch.zeros(per_node, nodes, dtype=torch.long, device=global_idx.device)
        per_source_node.index_add_(1, source_node, to_rank.t().long())
        # slots per expert of this node among the forwarded records: each (token, slot) reaches one forwarder
        node_experts = to_local_expert_ids(global_idx, self.node, per_node * experts_per_rank)
        per_expert = count_per_expert(node_experts, per_node * experts_per_rank).view(per_node, experts_per_rank)
        intra_hop, received, from_forwarders = make_hop(self.intra, to_rank, self.intra_links,
                                                        extra=torch.cat([per_source_node, per_expert], 1))

        # received[l', 1 + m']: rows that forwarder l' sends here from source node m', i.e. from rank m' * L + l'
        source_rank = torch.arange(nodes, device=received.device) * per_node + torch.arange(
            per_node, device=received.device).unsqueeze(1)
        rows = sum(f[0] for f in from_forwarders)
        row_source = torch.repeat_interleave(source_rank.reshape(-1), received[:, 1:1 + nodes].reshape(-1),
                                             output_size=rows)
        plan = Plan([rail_hop, intra_hop], order=torch.argsort(row_source, stable=True))
        moved = intra_hop.forward(forwarded, self.traffic, DISPATCH)
        counts = [sum(col) for col in zip(*(f[1 + nodes:] for f in from_forwarders))]
        return [f[plan.order] for f in moved], plan, counts
