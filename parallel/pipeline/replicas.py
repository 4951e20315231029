"""Parameters held by two pipeline ranks: their gradients are summed, and counted once in norms.

- Tied embedding (loop placements with MTP): the last stage keeps a replica of the first stage's
  embedding for the MTP; the two ranks form an embedding group, as in Megatron.
- DualPipe (mirror placement): ranks r and R-1-r hold the same two stages, each running half of
  the micro-batches, so every gradient (and every router's expert load) is summed over the pair.

V placements need neither: both model ends are on pipeline rank 0 and share one tensor. After the
sum both replicas hold the same gradient and take the same optimizer step, so they stay equal.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .ir import Placement

EMBEDDING = "embed_tokens.weight"


def replica_pairs(placement: Placement, tied_embedding: bool) -> tuple[list[tuple[int, int]], bool]:
    """Pipeline-rank pairs that share parameters, and whether they share all of them (mirror)."""
    if placement.kind == "mirror":
        ranks = placement.num_ranks
        return [(r, ranks - 1 - r) for r in range(ranks // 2)], True
    first, last = placement.rank_of(0), placement.rank_of(placement.num_stages - 1)
    return ([(first, last)] if tied_embedding and first != last else []), False


class PipelineReplicas:
    """The replica group of this rank (if any) and what to sum over it.

    `pipelines` lists the global ranks of every pipeline in pipeline-rank order (all ranks pass the
    same list, so the process groups are created in the same order everywhere).
    """

    def __init__(self, model: nn.Module, placement: Placement, pp_rank: int, pipelines: list[list[int]],
                 tied_embedding: bool, timeout_s: float) -> None:
        pairs, mirror = replica_pairs(placement, tied_embedding)
        self.mirror = mirror
        self.group: Optional[dist.ProcessGroup] = None
        self.params: list[nn.Parameter] = []
        self.norm_duplicates: list[nn.Parameter] = []
        mine = next((pair for pair in pairs if pp_rank in pair), None)
        for pipeline in pipelines:
            for pair in pairs:
                group = dist.new_group([pipeline[r] for r in pair], timeout=timedelta(seconds=timeout_s))
                if mine == pair and dist.get_rank() in (pipeline[r] for r in pair):
                    self.group = group
        if mine is None:
            return
        named = dict(model.named_parameters())
        self.params = list(named.values()) if mirror else [named[EMBEDDING]]
        if pp_rank == mine[1]:
            self.norm_duplicates = list(self.params)

    def reduce_gradients(self) -> None:
        """Sum the replicated gradients over the pair (before the data-parallel reduction)."""
        if self.group is None:
            return
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [param.grad for param in self.params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.group)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)

    def sum_loads(self, loads: torch.Tensor) -> torch.Tensor:
        """Expert loads of mirrored routers summed over the pair; in place."""
        if self.mirror and self.group is not None:
            dist.all_reduce(loads, group=self.group)
        return loads

    def destroy(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
