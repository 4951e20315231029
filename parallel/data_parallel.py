"""Data-parallel gradient reduction consistent with the global-batch mean, and global norms.

Each rank's loss is the mean over its own micro-batches, so the global loss is the mean over the
dp ranks of a stage. Dense gradients are therefore averaged over dp. An expert's gradient already
sums the contributions of every rank of its EP group (they flow back through combine/dispatch),
so expert gradients are summed over the expert-data-parallel replicas and divided by dp.
Without a topology (one process) every operation is the identity.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallel.topology import Topology

EXPERT_MARKER = ".experts."


def is_expert_parameter(name: str) -> bool:
    """Routed-expert weights are sharded over EP ranks; everything else is replicated over dp."""
    return EXPERT_MARKER in name


def _all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup, scale: float) -> None:
    if not tensors:
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    flat.mul_(scale)
    for tensor, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        tensor.copy_(reduced)


class GradientSync:
    """Gradient reduction, global gradient norm/clipping and expert-load reduction for one model."""

    def __init__(self, model: nn.Module, topology: Topology | None,
                 norm_duplicates: Iterable[nn.Parameter] = ()) -> None:
        """`norm_duplicates`: parameters another pipeline rank also holds and counts in the norm."""
        self.topology = topology
        self.norm_duplicates = {id(p) for p in norm_duplicates}
        self.dense, self.expert = [], []
        for name, param in model.named_parameters():
            (self.expert if is_expert_parameter(name) else self.dense).append(param)

    def _grads(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        return [param.grad for param in params]

    def reduce(self) -> None:
        topo = self.topology
        if topo is None:
            return
        _all_reduce_flat(self._grads(self.dense), topo.dp_group, 1.0 / topo.dp)
        _all_reduce_flat(self._grads(self.expert), topo.expert_dp_group, 1.0 / topo.dp)

    def global_norm(self) -> torch.Tensor:
        """L2 norm of the full model's reduced gradient, each replicated tensor counted once."""
        dense = [p.grad for p in self.dense if p.grad is not None and id(p) not in self.norm_duplicates]
        expert = [p.grad for p in self.expert if p.grad is not None and id(p) not in self.norm_duplicates]
        squares = torch.zeros((), dtype=torch.float32, device=(self.dense + self.expert)[0].device)
        topo = self.topology
        if topo is None or topo.dp_rank == 0:
            squares = squares + sum(g.float().pow(2).sum() for g in dense)
        if topo is None or topo.expert_dp_rank == 0:
            squares = squares + sum(g.float().pow(2).sum() for g in expert)
        if topo is not None:
            dist.all_reduce(squares)
        return squares.sqrt()

    def clip(self, max_norm: float) -> float:
        """Scale gradients as `torch.nn.utils.clip_grad_norm_` would on the whole model."""
        total = self.global_norm()
        if max_norm and max_norm > 0:
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for param in self.dense + self.expert:
                if param.grad is not None:
                    param.grad.mul_(coef)
        return total.item()

    def sum_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of `tensor` over this stage's dp ranks (expert loads, loss sums); in place."""
        if self.topology is not None:
            dist.all_reduce(tensor, group=self.topology.dp_group)
        return tensor
