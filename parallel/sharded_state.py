"""Checkpoint views of a (possibly expert-sharded, ZeRO-sharded) model and optimizer.

Keys are layout-independent: replicated tensors keep their module names, each routed expert is
its own key (`<name>.expert_<global id>`), and AdamW state is keyed by parameter name. Values are
views of the live tensors, so `torch.distributed.checkpoint` saves them as they are and loads
into them in place. A checkpoint written by one layout (one process, or any dp x ep) therefore
loads into any other: each rank simply asks for the keys it holds now. The EMA of the parameters
(moe_train.ema) is keyed the same way (`split_experts`). A bf16 model's parameters are saved as their
fp32 main parameters, each by a rank that owns it (parallel.mixed_precision).
"""
from __future__ import annotations

import torch
from torch import nn

from model.moe import RoutedExperts
from parallel.mixed_precision import checkpoint_values, main_param

ADAM_STATE = ("exp_avg", "exp_avg_sq")


def _expert_offsets(model: nn.Module) -> dict[str, int]:
    """Parameter name prefix of each RoutedExperts module -> global id of its first expert."""
    return {f"{name}.": module.first_expert for name, module in model.named_modules()
            if isinstance(module, RoutedExperts)}


def _split(name: str, tensor: torch.Tensor, offsets: dict[str, int], out: dict[str, torch.Tensor]) -> None:
    prefix = next((p for p in offsets if name.startswith(p)), None)
    if prefix is None:
        out[name] = tensor
        return
    for local, expert in enumerate(tensor):
        out[f"{name}.expert_{offsets[prefix] + local}"] = expert


def split_experts(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors`, keyed by `model`'s state names, with each routed expert's slice under its own key."""
    offsets = _expert_offsets(model)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        _split(name, tensor, offsets, out)
    return out


def model_state(model: nn.Module, values: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers (router biases included), experts split per expert: `values`
    (keyed as the state dict; a bf16 model's fp32 values, `mixed_precision.checkpoint_values`), by
    default what this rank saves."""
    return split_experts(model, checkpoint_values(model, loading=False) if values is None else values)


def _owned_parameters(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW moments and step of the parameters this rank's optimizer owns, created if absent.

    Creating zero state lets a fresh optimizer receive a checkpoint in place; AdamW then
    continues from the loaded step count.
    """
    offsets = _expert_offsets(model)
    names = {id(main_param(p)): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for param in _owned_parameters(optimizer):
        state = optimizer.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)  # where fused AdamW keeps it
            for key in ADAM_STATE:
                state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
        name = names[id(param)]
        out[f"{name}.step"] = state["step"]
        for key in ADAM_STATE:
            _split(f"{name}.{key}", state[key], offsets, out)
    return out
