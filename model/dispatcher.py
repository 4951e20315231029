"""The DeepEP-shaped dispatcher contract the MoE block talks to, and its local implementation.

`parallel.dispatch` provides the communicating backends; the model only ever sees this interface.
The MoE block applies router weights and sums over its local experts before `combine`, as DeepEP
requires, so `combine` is an unweighted sum over the ranks a token went to.

With an FP8 payload `recv_x` is the dequantization of the rows that travelled (E4M3, power-of-two
scales per row and 128 channels); `take_fp8_rows(handle)` hands those rows over once, for the experts'
FP8 GEMM to consume without quantizing `recv_x` again, and drops them from the handle, which the
combine keeps for its backward: the rows must not live that long.

`dispatch` returns the received top-k slots per local expert as a host list, as DeepEP's
`num_recv_tokens_per_expert_list`: a communicating backend learns them in the count exchange that
sizes its receive buffers, so reading them costs no further host sync. The local dispatcher moves
nothing and returns None: every slot of every token is local.

`PackedExchange` is the other contract, DeepEP's low-latency (decoding) shape: the tokens land in a
packed per-local-expert layout `[E_local, slots, H]` of which only the first `count[e]` rows of
expert e are valid, the experts run on that layout, and the exchange's combine applies the router
weights. `parallel.dispatch.low_latency_experts` provides it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

if TYPE_CHECKING:
    from model.fp8 import Fp8Tensor


def count_per_expert(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How often each expert id in [0, num_experts) occurs in `ids` (-1 = no expert is skipped), int64.

    Not `torch.bincount`: on CUDA it reads the largest id back to the host to size its output.
    """
    flat = ids.reshape(-1).long()
    bins = torch.where(flat >= 0, flat, num_experts)  # -1 goes to one extra bin, dropped
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    return counts.scatter_add_(0, bins, torch.ones_like(bins))[:num_experts]


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
                 layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int] | None, Any]: ...

    def take_fp8_rows(self, handle: Any) -> Fp8Tensor | None:
        """The received rows as they travelled in FP8 (1x128 tiles, `recv_x`'s order), released from
        `handle`; None without an FP8 payload or once taken."""
        ...

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor: ...


PackedExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (packed x [E, N, H], count [E]) -> [E, N, H]


class PackedExchange(Protocol):
    def run_experts(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    experts: PackedExperts) -> torch.Tensor:
        """sum_k topk_weights[t, k] * expert_{topk_idx[t, k]}(x[t]) for x [T, H], the experts applied by
        `experts` on the ranks that own them."""
        ...


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
            num_tokens_per_expert=count_per_expert(topk_idx, num_experts),
            is_token_in_rank=torch.ones(tokens, 1, dtype=torch.bool, device=topk_idx.device),
        )

    def dispatch(self, x, topk_idx, topk_weights, layout):
        return x, topk_idx, topk_weights, None, None

    def take_fp8_rows(self, handle: Any) -> None:
        return None

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        return y
