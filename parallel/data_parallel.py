"""Data-parallel gradient reduction consistent with the global-batch mean, and global norms.

Each rank's loss is the mean over its own micro-batches, so the global loss is the mean over the
dp ranks of a stage. Dense gradients are therefore averaged over dp. An expert's gradient already
sums the contributions of every rank of its EP group (they flow back through combine/dispatch),
so expert gradients are summed over the expert-data-parallel replicas and divided by dp.
Without a topology (one process) every operation is the identity. Gradients are read through
`parallel.mixed_precision` (fp32 `.grad`, or the fp32 main grads of bf16 parameters).

A reduction can also start piece by piece (`launch`, as the pipeline does once a parameter's
gradient is final) and be completed with `finish` before the optimizer step: each `launch` is one
asynchronous all-reduce per group over the flattened gradients it names, so the element-wise sums
are those of the one-shot `reduce` (every rank must launch the same pieces in the same order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallel.mixed_precision import current_grad, grad_buffer
from parallel.topology import Topology

EXPERT_MARKER = ".experts."


def is_expert_parameter(name: str) -> bool:
    """Routed-expert weights are sharded over EP ranks; everything else is replicated over dp."""
    return EXPERT_MARKER in name


@dataclass
class _InFlight:
    """One launched all-reduce: the flat buffer it reduces and the gradients it goes back into."""

    work: dist.Work
    flat: torch.Tensor
    grads: list[torch.Tensor]
    scale: float


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
        self.expert_ids = {id(p) for p in self.expert}
        self.in_flight: list[_InFlight] = []

    def _start(self, params: list[nn.Parameter], group: dist.ProcessGroup, scale: float) -> None:
        if not params:
            return
        grads = [grad_buffer(p) for p in params]
        flat = _flatten_dense_tensors(grads)
        self.in_flight.append(_InFlight(dist.all_reduce(flat, group=group, async_op=True), flat, grads, scale))

    def launch(self, params: Iterable[nn.Parameter], dense_group: Optional[dist.ProcessGroup] = None,
               expert_group: Optional[dist.ProcessGroup] = None) -> None:
        """Start reducing the gradients of `params` (final from now on): dense ones over dp, expert
        ones over expert-dp, asynchronously; `finish` completes them. Other groups may stand in
        for dp and expert-dp (pipeline replicas: their pair x dp), the scale staying 1/dp."""
        topo = self.topology
        if topo is None:
            return
        params = list(params)
        dense_group = topo.dp_group if dense_group is None else dense_group
        expert_group = topo.expert_dp_group if expert_group is None else expert_group
        self._start([p for p in params if id(p) not in self.expert_ids], dense_group, 1.0 / topo.dp)
        self._start([p for p in params if id(p) in self.expert_ids], expert_group, 1.0 / topo.dp)

    def finish(self) -> None:
        """Wait for every launched reduction and write the averaged gradients back."""
        for item in self.in_flight:
            item.work.wait()
            item.flat.mul_(item.scale)
            for grad, reduced in zip(item.grads, _unflatten_dense_tensors(item.flat, item.grads)):
                grad.copy_(reduced)
        self.in_flight = []

    def reduce(self) -> None:
        """The whole model's reduction at once (after the backward)."""
        self.launch(self.dense)
        self.launch(self.expert)
        self.finish()

    def global_norm(self) -> torch.Tensor:
        """L2 norm of the full model's reduced gradient, each replicated tensor counted once."""
        dense, expert = ([g for g in (current_grad(p) for p in params if id(p) not in self.norm_duplicates)
                          if g is not None] for params in (self.dense, self.expert))
        squares = torch.zeros((), dtype=torch.float32, device=(self.dense + self.expert)[0].device)
        topo = self.topology
        if topo is None or topo.dp_rank == 0:
            squares = squares + sum(g.float().pow(2).sum() for g in dense)
        if topo is None or topo.expert_dp_rank == 0:
            squares = squares + sum(g.float().pow(2).sum() for g in expert)
        if topo is not None:
            dist.all_reduce(squares)
        return squares.sqrt()

    def clip(self, max_norm: float) -> torch.Tensor:
        """Scale gradients as `torch.nn.utils.clip_grad_norm_` would on the whole model; returns the
        norm before clipping, on the device (the scaling reads nothing back to the host)."""
        total = self.global_norm()
        if max_norm and max_norm > 0:
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for grad in map(current_grad, self.dense + self.expert):
                if grad is not None:
                    grad.mul_(coef)
        return total

    def sum_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of `tensor` over this stage's dp ranks (expert loads, loss sums); in place."""
        if self.topology is not None:
            dist.all_reduce(tensor, group=self.topology.dp_group)
        return tensor
