"""Megatron-style mixed precision: bf16 parameters, fp32 main gradients, fp32 main parameters.

`train.precision=bf16` keeps every parameter of the model in bf16 (Megatron's Float16Module; buffers
such as the router biases stay fp32), so a forward makes no weight copies and the residual stream is
bf16. Three fp32 tensors stand behind a parameter, each a view of a data-parallel bucket
(parallel.grad_buffers):

- `main_grad`, on every rank and in both precisions: the weight gradients of all micro-batches
  accumulate into it (`accumulate_grad`, called by autograd's post-accumulate hook and by the
  pipeline's deferred W); the gradient exchange reduces it in place.
- the main parameter, only for the range of the parameter this rank's optimizer steps (its ZeRO-1
  piece, `param.main_piece`): for a bf16 parameter an fp32 copy of that range, rounded into the
  parameter after each step; an fp32 parameter is its own main parameter.
- checkpoints hold the main parameters (`checkpoint_values`), so a resume is exact.

A model that was never put into buckets (benchmarks, generation) has plain `.grad`s: the
accessors below fall back to them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from parallel.flat_range import FlatRange

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}  # fp8: bf16 parameters, FP8 GEMMs


def has_main_grad(param: nn.Parameter) -> bool:
    return hasattr(param, "main_grad")


def grad_buffer(param: nn.Parameter) -> torch.Tensor:
    """The fp32 gradient the optimizer reads: the main grad, or `.grad` (created as zeros if missing)."""
    if has_main_grad(param):
        return param.main_grad
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def current_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient accumulated so far (None where an fp32 parameter has none yet)."""
    return param.main_grad if has_main_grad(param) else param.grad


def accumulate_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Add one backward's weight gradient into `param`'s gradient buffer (fp32 main grad in bf16)."""
    grad_buffer(param).add_(grad)


@torch.no_grad()
def accumulate_weight_grad(param: nn.Parameter, compute: Callable[[], torch.Tensor]) -> None:
    """Add the weight gradient that `compute` returns outside autograd (model.fp8's FP8 Wgrad, in fp32)
    into `param`'s gradient buffer, unrounded: the `sink` of the FP8 GEMMs."""
    accumulate_grad(param, compute())


def zero_grad_buffers(params: Iterable[nn.Parameter]) -> None:
    """The per-step reset: zero every gradient buffer in place, creating those that are missing."""
    for param in params:
        if param.requires_grad:
            grad_buffer(param).zero_()


def release_grads(params: Iterable[nn.Parameter]) -> None:
    """After the optimizer step: fp32 `.grad`s are freed (set to None), main grads zeroed for the next step."""
    for param in params:
        param.grad = None
        if has_main_grad(param):
            param.main_grad.zero_()


def _fold_into_main_grad(param: nn.Parameter) -> None:
    """Autograd's post-accumulate hook (it also runs for a split GEMM's weight, whose gradient is None: W adds it)."""
    if param.grad is not None:
        accumulate_grad(param, param.grad)
        param.grad = None


def attach_main_grad(param: nn.Parameter, main_grad: torch.Tensor) -> None:
    """Make `main_grad` (fp32, `param`'s shape) the gradient buffer that autograd's gradients fold into."""
    if not hasattr(param, "main_grad"):
        param.register_post_accumulate_grad_hook(_fold_into_main_grad)
    param.main_grad = main_grad


def is_low_precision(param: nn.Parameter) -> bool:
    """A parameter whose fp32 main value lives beside it (bf16 training)."""
    return param.dtype != torch.float32 and has_main_grad(param)


def checkpoint_values(model: nn.Module, loading: bool) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with each bf16 parameter's value in fp32: when saving, the range of its main
    parameter this rank owns (a `FlatRange`; nothing where it owns none, other ranks write the rest);
    when `loading`, a fresh fp32 tensor of the whole parameter (`set_parameters` copies it in). An fp32
    model's state dict as it is."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        param = params.get(name)
        if param is None or not is_low_precision(param):
            out[name] = tensor
        elif loading:
            out[name] = torch.empty_like(param, dtype=torch.float32)
        elif hasattr(param, "main_piece"):
            piece = param.main_piece
            out[name] = FlatRange(param.shape, piece.start, piece.main)
    return out


@torch.no_grad()
def set_parameters(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """After a load into `checkpoint_values(model, loading=True)`: round the fp32 values into the bf16
    parameters and copy the owned range of each into its main parameter."""
    for name, param in model.named_parameters(remove_duplicate=False):
        if is_low_precision(param) and name in values:
            param.copy_(values[name])
            piece = getattr(param, "main_piece", None)
            if piece is not None:
                piece.main.copy_(values[name].reshape(-1)[piece.start:piece.stop])
