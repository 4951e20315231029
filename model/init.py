"""Layout-independent parameter initialisation.

Every tensor is drawn from its own generator seeded by (seed, parameter name), and every routed
expert by (seed, name, global expert id), so a model split over any number of expert-parallel or
pipeline ranks starts from exactly the weights of the single-process model.
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn

from model.layers import GroupedLinear, Linear, RMSNorm
from model.moe import RoutedExperts
from model.router import Router


def _generator(*key: object) -> torch.Generator:
    digest = hashlib.sha256(":".join(map(str, key)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _normal_(param: torch.Tensor, std: float, *key: object) -> None:
    values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=_generator(*key))
    param.copy_(values)


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: int, std: float) -> None:
    """Normal(0, std) for every weight (per expert for grouped experts), ones for norms."""
    covered: set[int] = set()
    expert_offsets = {}
    for name, module in model.named_modules():
        if isinstance(module, RoutedExperts):
            for child in ("gate_up_proj", "down_proj"):
                expert_offsets[f"{name}.{child}"] = module.first_expert
    for name, module in model.named_modules():
        if isinstance(module, GroupedLinear):
            first = expert_offsets.get(name, 0)
            for local, weight in enumerate(module.weight):
                _normal_(weight, std, seed, f"{name}.weight", first + local)
        elif isinstance(module, (Linear, Router, nn.Embedding)):
            _normal_(module.weight, std, seed, f"{name}.weight")
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        else:
            continue
        covered.add(id(module.weight))
    missed = [name for name, p in model.named_parameters() if id(p) not in covered]
    if missed:
        raise TypeError(f"initialize_parameters does not know how to initialise: {', '.join(missed)}")
