"""Checkpoint views of a (possibly expert-sharded, ZeRO-sharded) model and optimizer.

Keys are layout-independent: replicated tensors keep their module names, each routed expert is
its own key (`<name>.expert_<global id>`), and AdamW state is keyed by parameter name. Values are
views of the live tensors, so `torch.distributed.checkpoint` saves them as they are and loads
into them in place. A checkpoint written by one layout (one process, or any dp x ep) therefore
loads into any other: each rank simply asks for the keys it holds now. The EMA of the parameters
(moe_train.ema) is keyed the same way (`split_experts`). A bf16 model's parameters are saved as their
fp32 main parameters. What ZeRO-1 cuts at any element (main parameters, moments, EMA: a rank's
`Piece` of a parameter, parallel.grad_buffers) is saved as a `FlatRange` of the whole tensor, written
by the ranks that own its pieces (parallel.flat_range).
"""
from __future__ import annotations

import torch
from torch import nn

from model.moe import RoutedExperts
from parallel.flat_range import FlatRange
from parallel.grad_buffers import Piece
from parallel.mixed_precision import checkpoint_values
from parallel.zero import DistributedOptimizer

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
    rows = tensor.rows() if isinstance(tensor, FlatRange) else enumerate(tensor)
    for local, expert in rows:
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


def piece_state(model: nn.Module, pieces: list[Piece], values: dict[str, torch.Tensor],
                suffix: str = "") -> dict[str, torch.Tensor]:
    """`values` (one 1-D tensor per piece, by parameter name) as the `FlatRange`s of the pieces, keyed
    `<parameter name><suffix>`, experts split per expert."""
    offsets = _expert_offsets(model)
    out: dict[str, torch.Tensor] = {}
    for piece in pieces:
        _split(f"{piece.name}{suffix}", FlatRange(piece.param.shape, piece.start, values[piece.name].reshape(-1)),
               offsets, out)
    return out


def _pieces(model: nn.Module, optimizer: DistributedOptimizer | torch.optim.Optimizer) -> list[Piece]:
    """The optimizer's pieces; a plain torch optimizer over whole parameters owns each of them whole."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.pieces
    names = {id(p): n for n, p in model.named_parameters()}
    return [Piece(names[id(p)], p, 0, p.numel(), p, p.grad) for group in optimizer.param_groups for p in group["params"]]


def optimizer_state(model: nn.Module, optimizer: DistributedOptimizer | torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW moments and step of the pieces this rank's optimizer owns, created if absent.

    Creating zero state lets a fresh optimizer receive a checkpoint in place; AdamW then
    continues from the loaded step count. Every owner of a piece of a parameter holds its step.
    """
    out: dict[str, torch.Tensor] = {}
    pieces = _pieces(model, optimizer)
    piece_of = {id(piece.main): piece for piece in pieces}
    for piece in (piece_of[id(main)] for group in optimizer.param_groups for main in group["params"]):
        state = optimizer.state[piece.main]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=piece.main.device)  # where fused AdamW keeps it
            for key in ADAM_STATE:
                state[key] = torch.zeros_like(piece.main, memory_format=torch.preserve_format)
        out[f"{piece.name}.step"] = state["step"]
    for key in ADAM_STATE:
        out.update(piece_state(model, pieces, {p.name: optimizer.state[p.main][key] for p in pieces}, f".{key}"))
    return out
