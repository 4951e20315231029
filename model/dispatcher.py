"""The DeepEP-shaped dispatcher contract the MoE block talks to, and its local implementation.

`parallel.dispatch` provides the communicating backends; the model only ever sees this interface.
The MoE block applies router weights and sums over its local experts before `combine`, as DeepEP
requires, so `combine` is an unweighted sum over the ranks a token went to. Receive counts per
local expert are returned as a tensor (on the tokens' device) so the local path never syncs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class Layout:
    num_tokens_per_rank: torch.Tensor  # [R]
    num_tokens_per_expert: torch.Tensor  # [E]
    is_token_in_rank: torch.Tensor  # [N, R] bool
    num_tokens_per_node: torch.Tensor | None = None  # [nodes], hierarchical backends only


class Dispatcher(Protocol):
    num_ranks: int
    rank: int

    def local_experts(self, num_experts: int) -> range: ...

    def layout(self, topk_idx: torch.Tensor, num_experts: int) -> Layout: ...

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor: ...


class LocalDispatcher:
    """One rank owns every expert: dispatch and combine move nothing."""

    num_ranks = 1
    rank = 0

    def local_experts(self, num_experts: int) -> range:
        return range(num_experts)

    def layout(self, topk_idx: torch.Tensor, num_experts: int) -> Layout:
        tokens = topk_idx.shape[0]
        return Layout(
            num_tokens_per_rank=torch.tensor([tokens]),
            num_tokens_per_expert=torch.bincount(topk_idx.reshape(-1), minlength=num_experts),
            is_token_in_rank=torch.ones(tokens, 1, dtype=torch.bool, device=topk_idx.device),
        )

    def dispatch(self, x, topk_idx, topk_weights, layout):
        return x, topk_idx, topk_weights, layout.num_tokens_per_expert, None

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        return y
