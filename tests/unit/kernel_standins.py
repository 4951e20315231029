"""Pure-torch stand-ins of the kernels' emulated groups (`kernels_cuda.EmulatedGroup`,
`EmulatedInternodeGroup`): the same list API and numerics, for CPU tests of the code around them.
Rows arrive by global source rank, then source token; top-k ids become local, -1 elsewhere."""
from __future__ import annotations

import torch

from kernels_cuda import Config, Handle
from kernels_cuda.config import InternodeConfig
from kernels_cuda.internode import InternodeHandle
from parallel.dispatch.layout import compute_layout, to_local_expert_ids


def _slots(mask: torch.Tensor) -> torch.Tensor:
    """Per column, the running index of the set entries (a ring slot), -1 elsewhere."""
    return torch.where(mask, mask.int().cumsum(0) - 1, -1).int()


def _prefix(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).int()


def _rows(payload, index: torch.Tensor):
    return (payload[0][index], payload[1][index]) if isinstance(payload, tuple) else payload[index]


def _cat(rows: list):
    if isinstance(rows[0], tuple):
        return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
    return torch.cat(rows)


class _TorchGroup:
    """Layout and dispatch shared by both stand-ins; `_handle` and `combine` are the kernels' own."""

    def __init__(self, num_ranks: int, ranks_per_node: int) -> None:
        self.num_ranks, self.ranks_per_node = num_ranks, ranks_per_node
        self.calls: list[str] = []

    def get_dispatch_layout(self, topk_idx, num_experts):
        self.calls.append("layout")
        out = []
        for idx in topk_idx:
            lay = compute_layout(idx, num_experts, self.num_ranks, self.ranks_per_node)
            out.append((lay.num_tokens_per_rank.int(), lay.num_tokens_per_expert.int(), lay.is_token_in_rank))
        return out

    def dispatch(self, xs, topk_idx=None, topk_weights=None, num_experts=None, handles=None):
        R = self.num_ranks
        cached = handles is not None
        self.calls.append("cached_dispatch" if cached else "dispatch")
        in_rank = ([h.is_token_in_rank for h in handles] if cached else
                   [compute_layout(i, num_experts, R, self.ranks_per_node).is_token_in_rank for i in topk_idx])
        results = []
        for d in range(R):
            chosen = [in_rank[s][:, d].nonzero().flatten() for s in range(R)]
            recv_x = _cat([_rows(x, c) for x, c in zip(xs, chosen)])
            if cached:
                results.append((recv_x, None, None, [], handles[d]))
                continue
            local = torch.cat([to_local_expert_ids(topk_idx[s][c], d, num_experts // R) for s, c in enumerate(chosen)])
            weights = torch.cat([topk_weights[s][c] for s, c in enumerate(chosen)]).masked_fill(local < 0, 0)
            per_expert = torch.bincount(local[local >= 0], minlength=num_experts // R).tolist()
            results.append((recv_x, local, weights, per_expert, self._handle(d, in_rank, chosen)))
        return results


class TorchEmulatedGroup(_TorchGroup):
    """`EmulatedGroup` (one node): combine sums in fp32 in source-rank order, as the kernels' reducers."""

    def __init__(self, num_ranks: int) -> None:
        super().__init__(num_ranks, num_ranks)

    def _handle(self, d: int, in_rank: list[torch.Tensor], chosen: list[torch.Tensor]) -> Handle:
        """The fields the dispatcher and `combine` read; the channel tables stay empty."""
        prefix = torch.stack([m.sum(0) for m in in_rank]).cumsum(0).int()  # [src, dst], prefix over sources
        src_idx = torch.cat(chosen).int()
        return Handle(prefix, torch.empty(0), torch.empty(0), src_idx, in_rank[d], torch.empty(0),
                      int(src_idx.numel()), Config())

    def combine(self, ys, handles, topk_weights=None):
        self.calls.append("combine")
        R = self.num_ranks
        sums = [torch.zeros(h.is_token_in_rank.shape[0], ys[0].shape[1]) for h in handles]
        wsums = [None if topk_weights is None else torch.zeros(h.is_token_in_rank.shape[0], topk_weights[0].shape[1])
                 for h in handles]
        for s in range(R):
            for d in range(R):
                column = handles[d].rank_prefix_matrix[:, d]
                lo, hi = (int(column[s - 1]) if s else 0), int(column[s])
                rows = handles[d].recv_src_idx[lo:hi].long()
                sums[s].index_add_(0, rows, ys[d][lo:hi].float())
                if topk_weights is not None:
                    wsums[s].index_add_(0, rows, topk_weights[d][lo:hi].float())
        return [(x.to(ys[0].dtype), w) for x, w in zip(sums, wsums)]


class TorchEmulatedInternodeGroup(_TorchGroup):
    """`EmulatedInternodeGroup`. Rank = node * gpus_per_node + GPU. A token goes once over RDMA to each
    node it needs (to its rail's GPU there), which forwards it over NVLink; combine sums each node's rows
    in fp32 on that forwarder, rounds to the payload dtype, and sums the nodes' partial sums in fp32 at
    the source, as the kernels."""

    def __init__(self, num_nodes: int, gpus_per_node: int) -> None:
        super().__init__(num_nodes * gpus_per_node, gpus_per_node)
        self.num_nodes, self.gpus_per_node = num_nodes, gpus_per_node

    def _handle(self, d: int, in_rank: list[torch.Tensor], chosen: list[torch.Tensor]) -> InternodeHandle:
        """The fields the dispatcher and `combine` read; the channel tables stay empty."""
        G, nodes = self.gpus_per_node, self.num_nodes
        node, gpu = divmod(d, G)
        to_node = [m.view(-1, nodes, G).any(-1) for m in in_rank]
        # records received over RDMA as the rail's proxy: tokens of rank (m, gpu) that need this node
        records = [to_node[m * G + gpu][:, node].nonzero().flatten() for m in range(nodes)]
        targets = torch.cat([in_rank[m * G + gpu][r, node * G:(node + 1) * G] for m, r in enumerate(records)])
        empty = torch.empty(0, dtype=torch.int32)
        src_idx = torch.cat(chosen).int()
        return InternodeHandle(
            rdma_channel_prefix_matrix=empty, gbl_channel_prefix_matrix=empty,
            recv_rdma_rank_prefix_sum=_prefix([r.numel() for r in records]), recv_rdma_channel_offset=empty,
            recv_gbl_rank_prefix_sum=_prefix([c.numel() for c in chosen]), recv_gbl_channel_offset=empty,
            recv_src_idx=src_idx, is_token_in_rank=in_rank[d], send_rdma_head=_slots(to_node[d]),
            send_nvl_head=_slots(targets), num_recv_tokens=src_idx.numel(), num_rdma_recv_tokens=targets.shape[0],
            config=InternodeConfig())

    def combine(self, ys, handles, topk_weights=None):
        self.calls.append("combine")
        R, G = self.num_ranks, self.gpus_per_node
        dtype, width = ys[0].dtype, ys[0].shape[1]
        out = []
        for s in range(R):
            tokens = handles[s].is_token_in_rank.shape[0]
            total = torch.zeros(tokens, width)
            total_w = None if topk_weights is None else torch.zeros(tokens, topk_weights[0].shape[1])
            for node in range(self.num_nodes):
                partial = torch.zeros(tokens, width)
                for d in range(node * G, (node + 1) * G):
                    prefix = handles[d].recv_gbl_rank_prefix_sum.long()
                    lo, hi = (int(prefix[s - 1]) if s else 0), int(prefix[s])
                    rows = handles[d].recv_src_idx[lo:hi].long()
                    partial.index_add_(0, rows, ys[d][lo:hi].float())
                    if total_w is not None:
                        total_w.index_add_(0, rows, topk_weights[d][lo:hi].float())
                total += partial.to(dtype).float()
            out.append((total.to(dtype), total_w))
        return out
