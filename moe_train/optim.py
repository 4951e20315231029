"""AdamW with Megatron's parameter groups: no weight decay on 1-D parameters (norm weights).

Router correction biases are buffers, so they never reach the optimizer.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from moe_train.config import OptimConfig
from parallel.adamw import make_adamw
from parallel.mixed_precision import MainParamOptimizer, main_param
from parallel.topology import Topology
from parallel.zero import ZeroOneAdamW


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, optim: OptimConfig, zero1_topology: Topology | None = None,
                    main_params: bool = False):
    """AdamW with `optim.moment_dtype` moments (parallel.adamw.make_adamw); with a topology, ZeRO-1
    (state sharded over the data-parallel replicas, each rank's share stepped by the same AdamW).
    `main_params` (bf16 training): the AdamW steps fp32 main copies of the parameters it owns
    (parallel.mixed_precision); build it while the parameters are still fp32.

    Both AdamWs keep their step counts on the parameters' device, so a step reads no value back to
    the host (torch's unfused ones call `.item()` on each parameter's step count).
    """
    groups = parameter_groups(model, optim.weight_decay)
    make: Callable[[list[dict]], torch.optim.Optimizer] = partial(
        make_adamw, moment_dtype=optim.moment_dtype, lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2),
        eps=optim.adam_eps)
    if main_params:
        make = partial(MainParamOptimizer, make_optimizer=make)
    if zero1_topology is not None:
        return ZeroOneAdamW(model, groups, zero1_topology, make)
    return make(groups)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def master_weights(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The fp32 master value of each parameter this rank's optimizer steps (with ZeRO-1: its shard), by
    parameter name: the fp32 main parameters of a bf16 model, else the parameters themselves."""
    names = {id(main_param(p)): n for n, p in model.named_parameters()}
    return {names[id(p)]: p.detach() for group in optimizer.param_groups for p in group["params"]}
