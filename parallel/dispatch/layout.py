"""Dispatch layout (who receives which token) and global <-> local expert ids.

Experts are placed contiguously by global id: rank r of an EP group of R ranks owns experts
[r * E/R, (r + 1) * E/R). A top-k slot of -1 means "no expert" and sends the token nowhere.
"""
from __future__ import annotations

import torch

from model.dispatcher import Layout, count_per_expert


def token_in_rank(topk_idx: torch.Tensor, experts_per_rank: int, num_ranks: int) -> torch.Tensor:
    """[N, R] bool: does token n have an expert on rank r."""
    owner = torch.where(topk_idx >= 0, topk_idx // experts_per_rank, num_ranks)
    in_rank = torch.zeros(topk_idx.shape[0], num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    return in_rank.scatter_(1, owner, True)[:, :num_ranks].contiguous()


def compute_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int) -> Layout:
    """Per-rank, per-expert and per-node token counts and `is_token_in_rank` for one EP group."""
    tokens = topk_idx.shape[0]
    in_rank = token_in_rank(topk_idx, num_experts // num_ranks, num_ranks)
    in_node = in_rank.view(tokens, num_ranks // ranks_per_node, ranks_per_node).any(-1)
    return Layout(
        num_tokens_per_rank=in_rank.sum(0),
        num_tokens_per_expert=count_per_expert(topk_idx, num_experts),
        is_token_in_rank=in_rank,
        num_tokens_per_node=in_node.sum(0),
    )


def to_local_expert_ids(topk_idx: torch.Tensor, rank: int, experts_per_rank: int) -> torch.Tensor:
    """Global expert ids -> this rank's local ids, -1 for experts owned elsewhere (or no expert)."""
    local = topk_idx - rank * experts_per_rank
    owned = (topk_idx >= 0) & (local >= 0) & (local < experts_per_rank)
    return torch.where(owned, local, torch.full_like(local, -1))
