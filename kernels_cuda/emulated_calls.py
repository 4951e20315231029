"""The normal kernels' list API of the emulated groups (`EmulatedGroup`, `EmulatedInternodeGroup`): one
entry per rank in each argument and result, one launch for all ranks, over the group's engine
(`IntranodeEngine` or `InternodeEngine`)."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from kernels_cuda.inputs import Layout, Payload


class EmulatedCalls:
    """Layout, dispatch and combine of an emulated group (`self.engine`, `self.num_ranks`)."""

    engine: Any
    num_ranks: int

    def get_dispatch_layouts(self, topk_idx: Sequence[torch.Tensor], num_experts: int) -> list[Layout]:
        """Per rank: (num_tokens_per_rank, num_tokens_per_rdma_rank (per node; None on one node),
        num_tokens_per_expert, is_token_in_rank), as Buffer.get_dispatch_layout without the event."""
        return [self.engine.layout(idx, num_experts) for idx in topk_idx]

    def get_dispatch_layout(self, topk_idx: Sequence[torch.Tensor], num_experts: int) -> list[tuple[torch.Tensor, ...]]:
        """Per rank: (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)."""
        return [(per_rank, per_expert, in_rank)
                for per_rank, _, per_expert, in_rank in self.get_dispatch_layouts(topk_idx, num_experts)]

    def dispatch(self, xs: Sequence[Payload], topk_idx: Sequence[torch.Tensor] | None = None,
                 topk_weights: Sequence[torch.Tensor] | None = None, num_experts: int | None = None,
                 handles: Sequence[Any] | None = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Any = None, stalled_rank: int = -1, layouts: Sequence[Layout] | None = None) -> list[tuple]:
        """Per rank: (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle).
        Fresh: with `layouts` (get_dispatch_layouts', then `topk_idx` may be None: a dispatch without
        top-k), else the layouts of `topk_idx`; cached with `handles`."""
        R = self.num_ranks
        if handles is not None:
            layouts = [None] * R
        elif layouts is None:
            if topk_idx is None or num_experts is None:
                raise ValueError("a fresh dispatch needs topk_idx and num_experts, or layouts")
            layouts = self.get_dispatch_layouts(topk_idx, num_experts)
        if layouts[0] is not None:
            num_experts = layouts[0][2].numel()
        return self.engine.dispatch(range(R), xs, topk_idx or [None] * R, topk_weights or [None] * R, layouts,
                                    handles or [None] * R, num_experts or R, expert_alignment, num_worst_tokens,
                                    config, stalled_rank)

    def combine(self, ys: Sequence[torch.Tensor], handles: Sequence[Any],
                topk_weights: Sequence[torch.Tensor] | None = None, config: Any = None,
                stalled_rank: int = -1) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per rank: (combined_x, combined_topk_weights): unweighted sums over the ranks each token went to."""
        return self.engine.combine(range(self.num_ranks), ys, handles, topk_weights or [None] * self.num_ranks,
                                   config, stalled_rank)

    def error_record(self) -> dict[str, Any]:
        return self.engine.error_record()
