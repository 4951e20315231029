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
from parallel.grad_buffers import ParamBuffers
from parallel.zero import DistributedOptimizer


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, buffers: ParamBuffers, optim: OptimConfig) -> DistributedOptimizer:
    """AdamW with `optim.moment_dtype` moments (parallel.adamw.make_adamw) over this rank's pieces of
    `buffers` (all of every parameter without ZeRO-1; parallel.zero).

    Both AdamWs keep their step counts on the parameters' device, so a step reads no value back to
    the host (torch's unfused ones call `.item()` on each parameter's step count).
    """
    make: Callable[[list[dict]], torch.optim.Optimizer] = partial(
        make_adamw, moment_dtype=optim.moment_dtype, lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2),
        eps=optim.adam_eps)
    return DistributedOptimizer(buffers, parameter_groups(model, optim.weight_decay), make)


def set_learning_rate(optimizer: torch.optim.Optimizer | DistributedOptimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
