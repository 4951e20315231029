"""Per-step schedules: learning rate (warmup+cosine, DeepSeek-V3's shape), router bias update
rate and MTP loss weight (DeepSeek-V3 changes both late in training).

`step` is where the optimizer step about to be taken stands: the samples consumed before it over
train.global_batch_size, which is its 0-based index at a constant batch. Under a batch ramp
(train.rampup_batch_size, moe_train.batch_ramp) it is fractional, so every schedule follows the consumed
samples, as Megatron's do with a ramp, and its *_steps keys count train.global_batch_size samples each.
"""
from __future__ import annotations

import math

from model.args import ModelArgs
from moe_train.config import OptimConfig


def _cosine(lr: float, min_lr: float, progress: float) -> float:
    progress = min(max(progress, 0.0), 1.0)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def learning_rate(step: float, optim: OptimConfig, total_steps: int, size: float = 1.0) -> float:
    """warmup (linear, reaching lr * (step + size) / warmup at the end of this step, `size` its batch over
    train.global_batch_size: lr/warmup for the first step at a constant batch) then:
    constant: lr;  cosine: lr -> min_lr over lr_decay_steps (default: the rest of training);
    dsv3: lr for lr_constant_steps, cosine to min_lr over lr_decay_steps, min_lr, and lr_tail for
    the last lr_tail_steps of training.
    """
    warmup = optim.lr_warmup_steps
    if step < warmup:
        return optim.lr * min(step + size, warmup) / warmup
    if optim.lr_schedule == "constant":
        return optim.lr
    after = step - warmup
    if optim.lr_schedule == "cosine":
        decay = optim.lr_decay_steps or max(total_steps - warmup, 1)
        return _cosine(optim.lr, optim.min_lr, after / decay)
    if step >= total_steps - optim.lr_tail_steps:
        return optim.lr_tail
    if after < optim.lr_constant_steps:
        return optim.lr
    decay = optim.lr_decay_steps or max(total_steps - warmup - optim.lr_constant_steps - optim.lr_tail_steps, 1)
    return _cosine(optim.lr, optim.min_lr, (after - optim.lr_constant_steps) / decay)


def bias_update_rate(step: float, optim: OptimConfig, model: ModelArgs) -> float:
    switch = optim.bias_update_switch_step
    if switch is not None and step >= switch:
        return optim.bias_update_rate_final
    return model.moe_router_bias_update_rate


def mtp_loss_scale(step: float, optim: OptimConfig, model: ModelArgs) -> float:
    switch = optim.mtp_loss_switch_step
    if switch is not None and step >= switch:
        return optim.mtp_loss_scale_final
    return model.mtp_loss_scaling_factor
