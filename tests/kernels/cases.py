"""Inputs for the GPU tests: routings (random, skewed), rank-encoded and random payloads."""
from __future__ import annotations

import torch


def routing(kind: str, num_ranks: int, num_tokens: int, num_experts: int, num_topk: int, seed: int,
            device: str = "cuda") -> list[torch.Tensor]:
    """topk_idx per rank [N, K] int64; -1 marks an empty slot."""
    g = torch.Generator().manual_seed(seed)
    local = num_experts // num_ranks
    out = []
    for rank in range(num_ranks):
        scores = torch.rand(num_tokens, num_experts, generator=g)
        if kind == "all_to_one_rank":
            scores[:, : num_experts - local] = -1
        elif kind == "rank_receives_nothing":
            scores[:, local: 2 * local] = -1
        idx = scores.topk(min(num_topk, local if kind == "all_to_one_rank" else num_topk), dim=1).indices
        if idx.shape[1] < num_topk:
            idx = torch.cat([idx, torch.full((num_tokens, num_topk - idx.shape[1]), -1)], 1)
        drop = torch.rand(num_tokens, num_topk, generator=g) < 0.1  # some empty slots
        idx = idx.masked_fill(drop, -1)
        idx[torch.arange(num_tokens) % 7 == 3] = -1  # tokens with no expert at all
        out.append(idx.to(device))
    return out


def payload(kind: str, num_ranks: int, num_tokens: int, hidden: int, dtype: torch.dtype, seed: int,
            device: str = "cuda") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "rank":
        return [torch.full((num_tokens, hidden), float(r), dtype=dtype, device=device) for r in range(num_ranks)]
    return [torch.randn(num_tokens, hidden, generator=g).to(dtype).to(device) for _ in range(num_ranks)]


def weights(num_ranks: int, num_tokens: int, num_topk: int, seed: int, device: str = "cuda") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 2)
    return [torch.rand(num_tokens, num_topk, generator=g).to(device) for _ in range(num_ranks)]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows, column-major float scales [N, H/128]) as DeepEP's tests pass them (strided)."""
    from parallel.dispatch.fp8 import quantize_e4m3

    q, scales = quantize_e4m3(x)
    return q, scales.T.contiguous().T


def node_limited_routing(num_nodes: int, gpus_per_node: int, num_tokens: int, num_experts: int, num_topk: int,
                         max_nodes: int, seed: int, device: str = "cuda") -> list[torch.Tensor]:
    """topk_idx per rank with every token's experts inside at most `max_nodes` nodes (DeepSeek-V3's
    group-limited routing with groups = nodes), some slots and some whole tokens empty."""
    g = torch.Generator().manual_seed(seed)
    per_node = num_experts // num_nodes
    out = []
    for _ in range(num_nodes * gpus_per_node):
        scores = torch.rand(num_tokens, num_experts, generator=g)
        nodes = torch.rand(num_tokens, num_nodes, generator=g).topk(max_nodes, dim=1).indices
        allowed = torch.zeros(num_tokens, num_nodes, dtype=torch.bool).scatter_(1, nodes, True)
        scores = scores.masked_fill(~allowed.repeat_interleave(per_node, dim=1), -1)
        idx = scores.topk(min(num_topk, max_nodes * per_node), dim=1).indices
        idx = idx.masked_fill(torch.rand(idx.shape, generator=g) < 0.1, -1)
        idx[torch.arange(num_tokens) % 7 == 3] = -1
        out.append(idx.to(device))
    return out
