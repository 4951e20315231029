"""Parameters held by two pipeline ranks: their gradients are summed over the pair.

- Tied embedding (loop placements with MTP): the last stage keeps a replica of the first stage's
  embedding for the MTP; the two ranks form an embedding group, as in Megatron.
- DualPipe (mirror placement): ranks r and R-1-r hold the same two stages, each running half of
  the micro-batches, so every gradient (and every router's expert load) is summed over the pair.

V placements need neither: both model ends are on pipeline rank 0 and share one tensor. After the
sum both replicas hold the same gradient and take the same optimizer step, so they stay equal.

With data parallelism the copies of a replicated parameter sit on the pair x its dp (expert: its
expert-dp) replicas: that combined group is their replica group in the data-parallel buckets
(parallel.grad_buffers), so one reduction over it, scaled 1/dp by `GradientSync`, is both the pair
sum and the dp average, ZeRO-1 shards them over it (each element counted once in the norm), and it
can start as soon as the gradients are final, like the others. The two pair members finish their
copies at different points of different programs, so the parameters are released in one canonical
order instead, the order of their buckets: a parameter goes once it and every earlier one are final
here, so both members complete the same buckets in the same order, each as early as it can. The order is the model's, or for DualPipe (every
parameter replicated) the one `order_by_release` derives from both members' programs.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallel.mixed_precision import grad_buffer

from .ir import Placement

EMBEDDING = "embed_tokens.weight"


def replica_pairs(placement: Placement, tied_embedding: bool) -> tuple[list[tuple[int, int]], bool]:
    """Pipeline-rank pairs that share parameters, and whether they share all of them (mirror)."""
    if placement.kind == "mirror":
        ranks = placement.num_ranks
        return [(r, ranks - 1 - r) for r in range(ranks // 2)], True
    first, last = placement.rank_of(0), placement.rank_of(placement.num_stages - 1)
    return ([(first, last)] if tied_embedding and first != last else []), False


def release_order(params: list[nn.Parameter], positions: list[dict[int, int]]) -> list[nn.Parameter]:
    """Canonical order from where each parameter becomes final in the pair's programs (`positions`,
    one per member, as `grad_ready.release_positions`): by the later of the two, then by `params`'
    order. Both members compute the same order; with the model's order every parameter would wait
    for the embedding, final only near the end of a DualPipe step."""
    index = {id(p): i for i, p in enumerate(params)}
    return sorted(params, key=lambda p: (max(pos[id(p)] for pos in positions), index[id(p)]))


class PipelineReplicas:
    """The replica group of this rank (if any) and what to sum over it.

    `pipelines` lists the global ranks of every pipeline in pipeline-rank order, its index being the
    dp rank (all ranks pass the same list, so the process groups are created in the same order
    everywhere); `ep` splits the dp ranks into expert-dp groups (dp rank d holds expert shard d % ep).
    `params` is in the canonical release order (the model's unless `order_by_release` changes it).
    """

    def __init__(self, model: nn.Module, placement: Placement, pp_rank: int, pipelines: list[list[int]],
                 tied_embedding: bool, timeout_s: float, ep: int = 1) -> None:
        pairs, mirror = replica_pairs(placement, tied_embedding)
        self.mirror = mirror
        self.group: Optional[dist.ProcessGroup] = None
        self.dense_group: Optional[dist.ProcessGroup] = None
        self.expert_group: Optional[dist.ProcessGroup] = None
        self.params: list[nn.Parameter] = []
        mine = next((pair for pair in pairs if pp_rank in pair), None)
        self.pair: Optional[tuple[int, int]] = mine
        timeout = timedelta(seconds=timeout_s)
        for pipeline in pipelines:
            for pair in pairs:
                group = dist.new_group([pipeline[r] for r in pair], timeout=timeout)
                if mine == pair and dist.get_rank() in (pipeline[r] for r in pair):
                    self.group = group
        dp = len(pipelines)
        for pair in pairs:  # pair x dp, then pair x each expert-dp group (the tied embedding is dense)
            for index, dp_ranks in enumerate([range(dp)] + [range(e, dp, ep) for e in range(ep if mirror else 0)]):
                ranks = sorted(pipelines[d][r] for r in pair for d in dp_ranks)
                group = dist.new_group(ranks, timeout=timeout)
                if dist.get_rank() in ranks:
                    if index == 0:
                        self.dense_group = group
                    else:
                        self.expert_group = group
        self._final: set[int] = set()
        self._released = 0
        if mine is None:
            return
        named = dict(model.named_parameters())
        self.params = list(named.values()) if mirror else [named[EMBEDDING]]

    def order_by_release(self, positions: list[dict[int, int]]) -> None:
        """Release the parameters in `release_order` instead of the model's order."""
        self.params = release_order(self.params, positions)

    def start(self) -> None:
        """A new step: no replicated gradient final yet."""
        self._final = set()
        self._released = 0

    def release(self, ready: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """Record parameters whose gradient became final here; returns those now due, in canonical
        order: the longest run of final parameters after the ones already released."""
        self._final.update(id(p) for p in ready)
        start = self._released
        while self._released < len(self.params) and id(self.params[self._released]) in self._final:
            self._released += 1
        return self.params[start:self._released]

    def assert_released(self) -> None:
        """End-of-step check: every replicated parameter was released."""
        if self._released != len(self.params):
            raise RuntimeError(f"{len(self.params) - self._released} replicated parameters were not released")

    def reduce_gradients(self) -> None:
        """Sum the replicated gradients over the pair (before the data-parallel reduction)."""
        if self.group is None:
            return
        grads = [grad_buffer(param) for param in self.params]
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
        for group in {id(g): g for g in (self.group, self.dense_group, self.expert_group) if g is not None}.values():
            dist.destroy_process_group(group)
        self.group = self.dense_group = self.expert_group = None
