"""Data-parallel gradient reduction consistent with the global-batch mean, and global norms.

Each rank's loss is the mean over its own micro-batches, so the global loss is the mean over the
dp ranks of a stage. Dense gradients are therefore averaged over dp. An expert's gradient already
sums the contributions of every rank of its EP group (they flow back through combine/dispatch),
so expert gradients are summed over the expert-data-parallel replicas and divided by dp.

The gradients live in the buckets of `parallel.grad_buffers` (`build_buffers` groups a model's
parameters by replica group). A bucket's reduction starts as soon as every gradient in it is final
(`launch`, called by the pipeline as the step goes, in an order every member of the group shares)
and `finish` completes them before the optimizer step: with ZeRO-1 a reduce-scatter, each rank
then holding the sum of the range it owns, else an all-reduce. The norm and clipping read only the
owned ranges, each element counted once in the job.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from parallel.grad_buffers import DEFAULT_BUCKET_ELEMENTS, LOCAL, Bucket, ParamBuffers, ReplicaGroup
from parallel.topology import Topology

EXPERT_MARKER = ".experts."


def is_expert_parameter(name: str) -> bool:
    """Routed-expert weights are sharded over EP ranks; everything else is replicated over dp."""
    return EXPERT_MARKER in name


def build_buffers(model: nn.Module, topology: Topology | None, dtype: torch.dtype, shard: bool,
                  bucket_elements: int = DEFAULT_BUCKET_ELEMENTS, order: Optional[Callable[[nn.Parameter], int]] = None,
                  replicated: Sequence[nn.Parameter] = (), replica_groups: tuple[Optional[dist.ProcessGroup], ...] = (None, None)
                  ) -> ParamBuffers:
    """`model`'s trainable parameters in buckets (parallel.grad_buffers), in `dtype`: dense ones over dp,
    routed experts over expert-dp, and `replicated` (held by another pipeline rank too, in their
    canonical order) over `replica_groups` (dense, expert: pair x dp, pair x expert-dp). `order` sorts
    the others by when their gradient becomes final (default: the model's order). Without a topology
    every group is this process alone."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if order is not None:
        named.sort(key=lambda item: order(item[1]))
    position = {id(p): i for i, p in enumerate(replicated)}
    names = {id(p): n for n, p in named}
    replicas = [(names[id(p)], p) for p in replicated]
    others = [(n, p) for n, p in named if id(p) not in position]
    dp, expert_dp, pair_dense, pair_expert = ((LOCAL,) * 4 if topology is None else
                                              (ReplicaGroup.of(topology.group("dp")), ReplicaGroup.of(topology.group("expert_dp")),
                                               *(ReplicaGroup.of(g) if g is not None else LOCAL for g in replica_groups)))
    groups = [([(n, p) for n, p in others if not is_expert_parameter(n)], dp),
              ([(n, p) for n, p in others if is_expert_parameter(n)], expert_dp),
              ([(n, p) for n, p in replicas if not is_expert_parameter(n)], pair_dense),
              ([(n, p) for n, p in replicas if is_expert_parameter(n)], pair_expert)]
    return ParamBuffers([(params, group) for params, group in groups if params], dtype, shard, bucket_elements)


class GradientSync:
    """Gradient reduction, global gradient norm/clipping and expert-load reduction for one model's buffers."""

    def __init__(self, buffers: ParamBuffers, topology: Topology | None) -> None:
        self.buffers, self.topology = buffers, topology
        self.scale = 1.0 if topology is None else 1.0 / topology.dp
        self._index = {id(b): i for i, b in enumerate(buffers.buckets)}
        self._pending: dict[int, int] = {}
        self._reset()

    def _reset(self) -> None:
        self._pending = {id(b): len(b.params) for b in self.buffers.buckets}

    def _start(self, bucket: Bucket) -> None:
        self.buffers.count(bucket.start_reduction())

    def launch(self, params: Iterable[nn.Parameter]) -> None:
        """Record that the gradients of `params` are final; start the reduction of each bucket now
        complete (in bucket order, so every member of a group starts the same collectives in order)."""
        complete = []
        for param in params:
            bucket = self.buffers.bucket_of[id(param)]
            self._pending[id(bucket)] -= 1
            if self._pending[id(bucket)] == 0:
                complete.append(bucket)
        for bucket in sorted(complete, key=lambda b: self._index[id(b)]):
            self._start(bucket)

    def finish(self) -> None:
        """Start what is not started yet (in bucket order: without a pipeline, every bucket after the
        backward), wait for every reduction and average the owned gradients over dp."""
        for bucket in self.buffers.buckets:
            if not bucket.started:
                self._start(bucket)
        for bucket in self.buffers.buckets:
            bucket.finish_reduction(self.scale)
        self._reset()

    def global_norm(self) -> torch.Tensor:
        """L2 norm of the full model's reduced gradient, each element counted once in the job."""
        buckets = [b for b in self.buffers.buckets if b.counts_in_norm()]
        squares = torch.zeros((), dtype=torch.float32, device=self.buffers.buckets[0].grad.device)
        for bucket in buckets:
            squares = squares + bucket.grad[bucket.owned.start:bucket.owned.stop].pow(2).sum()
        if self.topology is not None:
            dist.all_reduce(squares)
        return squares.sqrt()

    def clip(self, max_norm: float) -> torch.Tensor:
        """Scale gradients as `torch.nn.utils.clip_grad_norm_` would on the whole model; returns the
        norm before clipping, on the device (the scaling reads nothing back to the host)."""
        total = self.global_norm()
        if max_norm and max_norm > 0:
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for bucket in self.buffers.buckets:
                bucket.grad[bucket.owned.start:bucket.owned.stop].mul_(coef)
        return total

    def sum_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of `tensor` over this stage's dp ranks (expert loads, loss sums); in place."""
        if self.topology is not None:
            dist.all_reduce(tensor, group=self.topology.group("dp"))
        return tensor
