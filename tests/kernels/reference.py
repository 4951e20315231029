"""Pure-torch reference of intranode dispatch/combine for all ranks of one process (the oracle)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.dispatch.layout import compute_layout, to_local_expert_ids


@dataclass
class RankReceive:
    x: torch.Tensor            # rows by source rank, then source token order
    src_rank: torch.Tensor
    src_idx: torch.Tensor
    topk_idx: torch.Tensor     # local expert ids, -1 elsewhere
    topk_weights: torch.Tensor  # 0 where topk_idx is -1
    per_expert: list[int]


def reference_dispatch(xs: list[torch.Tensor], topk_idx: list[torch.Tensor], topk_weights: list[torch.Tensor],
                       num_experts: int) -> list[RankReceive]:
    R = len(xs)
    local = num_experts // R
    layouts = [compute_layout(idx, num_experts, R, R) for idx in topk_idx]
    out = []
    for d in range(R):
        rows, src_rank, src_idx, idx, w = [], [], [], [], []
        for s in range(R):
            chosen = layouts[s].is_token_in_rank[:, d].nonzero().flatten()
            rows.append(xs[s][chosen])
            src_rank.append(torch.full_like(chosen, s))
            src_idx.append(chosen)
            ids = to_local_expert_ids(topk_idx[s][chosen], d, local)
            idx.append(ids)
            w.append(topk_weights[s][chosen].masked_fill(ids < 0, 0))
        ids = torch.cat(idx)
        counts = torch.bincount(ids[ids >= 0], minlength=local).tolist()
        out.append(RankReceive(torch.cat(rows), torch.cat(src_rank), torch.cat(src_idx), ids, torch.cat(w), counts))
    return out


def reference_combine(ys: list[torch.Tensor], received: list[RankReceive], num_tokens: list[int]) -> list[torch.Tensor]:
    """Per source rank: the fp32 sum, over the ranks each token went to, of its rows (cast back)."""
    R = len(ys)
    sums = [torch.zeros(num_tokens[s], ys[0].shape[1], dtype=torch.float32, device=ys[0].device) for s in range(R)]
    for d in range(R):
        for s in range(R):
            mine = received[d].src_rank == s
            sums[s].index_add_(0, received[d].src_idx[mine], ys[d][mine].float())
    return [t.to(ys[0].dtype) for t in sums]


def layouts_of(topk_idx: list[torch.Tensor], num_experts: int):
    R = len(topk_idx)
    return [compute_layout(idx, num_experts, R, R) for idx in topk_idx]
