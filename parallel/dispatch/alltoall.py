"""Flat expert-parallel dispatch: one `all_to_all` over the EP group, one copy per (token, rank)."""
from __future__ import annotations

import torch

from model.dispatcher import Layout
from parallel.dispatch.base import INTER_NODE, INTRA_NODE, ExchangeDispatcher, Plan, make_hop
from parallel.dispatch.comm import Comm


class AllToAllDispatcher(ExchangeDispatcher):
    """Every token goes straight to each rank that owns one of its experts, on whatever link."""

    def __init__(self, ep: Comm, num_experts: int, ranks_per_node: int, fp8: bool = False) -> None:
        super().__init__(num_experts, ep.size, ep.rank, ranks_per_node, fp8)
        self.comm = ep
        node = ep.rank // ranks_per_node
        self.links = [None if peer == ep.rank else INTRA_NODE if peer // ranks_per_node == node else INTER_NODE
                      for peer in range(ep.size)]

    def route(self, fields: list[torch.Tensor], layout: Layout) -> tuple[list[torch.Tensor], Plan, list[int]]:
        per_peer_expert = layout.num_tokens_per_expert.view(self.num_ranks, self.experts_per_rank)
        hop, _, from_peers = make_hop(self.comm, layout.is_token_in_rank, self.links, extra=per_peer_expert)
        plan = Plan([hop])
        return plan.forward(fields, self.traffic), plan, [sum(col) for col in zip(*(p[1:] for p in from_peers))]
