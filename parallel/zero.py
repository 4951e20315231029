"""ZeRO stage 1: AdamW whose state for each parameter lives on one owner rank of its replica group.

Written here rather than reusing `torch.distributed.optim.ZeroRedundancyOptimizer` because our
parameters have two kinds of replica groups (dense: data-parallel; routed experts: expert-data-
parallel, the experts being sharded over EP), and because checkpoints must address optimizer
state by parameter name so a run can resume with another layout.
After the owner's step, each owner broadcasts its updated parameters (one flat buffer per owner).
Each owner steps its tensors with the run's optimizer (built by `make_local`: parallel.adamw's AdamW,
fp32 or bf16 moments, possibly over fp32 main parameters), so the result equals the unsharded
optimizer bit for bit up to the reduction order of the gradients.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallel.data_parallel import is_expert_parameter
from parallel.topology import Topology


def partition(sizes: list[int], members: int) -> list[int]:
    """Owner index for each tensor: greedy by size onto the least-loaded member (deterministic)."""
    load = [0] * members
    owners = []
    for size in sizes:
        owner = min(range(members), key=lambda m: (load[m], m))
        owners.append(owner)
        load[owner] += size
    return owners


class ZeroOneAdamW:
    """AdamW with optimizer state sharded over dp (dense) and expert-dp (experts).

    `param_groups` are AdamW parameter groups of `model` (e.g. with and without weight decay);
    `make_local` builds this rank's local optimizer from the same groups restricted to the parameters
    it owns (an AdamW, or one stepping their fp32 main parameters: `parallel.mixed_precision`). The
    broadcast moves the parameters in their own dtype (bf16 parameters: half the bytes of fp32).
    """

    def __init__(self, model: nn.Module, param_groups: list[dict], topology: Topology,
                 make_local: Callable[[list[dict]], torch.optim.Optimizer]) -> None:
        self.model, self.topology = model, topology
        expert_ids = {id(p) for n, p in model.named_parameters() if is_expert_parameter(n)}
        group_of = {id(p): index for index, group in enumerate(param_groups) for p in group["params"]}
        local_groups = [{**group, "params": []} for group in param_groups]
        self.broadcast_plan: list[tuple[dist.ProcessGroup, int, list[nn.Parameter]]] = []
        for expert, group, ranks, my_index in (
                (False, topology.dp_group, topology.ranks("dp"), topology.dp_rank),
                (True, topology.expert_dp_group, topology.ranks("expert_dp"), topology.expert_dp_rank)):
            params = [p for p in model.parameters() if id(p) in group_of and (id(p) in expert_ids) == expert]
            owners = partition([p.numel() for p in params], len(ranks))
            for member, src in enumerate(ranks):
                mine = [p for p, owner in zip(params, owners) if owner == member]
                if mine:
                    self.broadcast_plan.append((group, src, mine))
            for param, owner in zip(params, owners):
                if owner == my_index:
                    local_groups[group_of[id(param)]]["params"].append(param)
        self.local = make_local(local_groups)

    @property
    def param_groups(self) -> list[dict]:
        return self.local.param_groups

    @property
    def state(self) -> dict:
        return self.local.state

    @property
    def found_inf(self) -> torch.Tensor | None:
        """GradScaler's protocol, passed to the local AdamW: a 1.0 tensor skips the step on the device."""
        return getattr(self.local, "found_inf", None)

    @found_inf.setter
    def found_inf(self, value: torch.Tensor | None) -> None:
        self.local.found_inf = value

    @torch.no_grad()
    def step(self) -> None:
        self.local.step()
        for group, src, params in self.broadcast_plan:
            flat = _flatten_dense_tensors([p.data for p in params])
            dist.broadcast(flat, src=src, group=group)
            if self.topology.rank != src:
                for param, value in zip(params, _unflatten_dense_tensors(flat, params)):
                    param.data.copy_(value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)
