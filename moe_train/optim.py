"""AdamW with Megatron's parameter groups: no weight decay on 1-D parameters (norm weights).

Router correction biases are buffers, so they never reach the optimizer.
"""
from __future__ import annotations

import torch
from torch import nn

from moe_train.config import OptimConfig


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(parameter_groups(model, optim.weight_decay), lr=optim.lr,
                             betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
