"""Megatron-style mixed precision: bf16 parameters, fp32 main gradients, fp32 main parameters.

`train.precision=bf16` casts every parameter of the model to bf16 (Megatron's Float16Module; buffers
such as the router biases stay fp32), so a forward makes no weight copies and the residual stream is
bf16. Three fp32 tensors stand behind a bf16 parameter:

- `main_grad`, on every rank: the weight gradients of all micro-batches accumulate into it
  (`accumulate_grad`, called by autograd's post-accumulate hook and by the pipeline's deferred W);
  the gradient reduction, the norm and clipping read it through `grad_buffer`.
- the main parameter, only where the optimizer steps the tensor (with ZeRO-1: on its owner): an
  fp32 copy whose `.grad` is the main grad, so any AdamW-like optimizer steps plain fp32 tensors
  (`MainParamOptimizer`); the owner then rounds it into the bf16 parameter.
- checkpoints hold the main parameters (`checkpoint_values`), so a resume is exact.

An fp32 model has none of them: its parameters are their own main parameters and `.grad` their
main gradients, so fp32 runs are what they were.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

PARAM_DTYPE = torch.bfloat16


def main_param(param: nn.Parameter) -> torch.Tensor:
    """The fp32 tensor the optimizer steps for `param`: its main parameter, or `param` itself (fp32 model)."""
    return getattr(param, "main_param", param)


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


def use_bf16_parameters(model: nn.Module) -> None:
    """Cast every parameter of `model` to bf16 in place (the same Parameter objects, so optimizer
    references hold) and give each an fp32 `main_grad` that autograd's gradients fold into."""
    for param in model.parameters():
        param.data = param.data.to(PARAM_DTYPE)
        if param.requires_grad:
            param.main_grad = torch.zeros_like(param, dtype=torch.float32)
            param.register_post_accumulate_grad_hook(_fold_into_main_grad)


class MainParamOptimizer:
    """Steps fp32 main copies of the parameters in `param_groups` with the optimizer `make_optimizer`
    builds on them (their `.grad` is each parameter's main grad), then rounds them into the parameters.

    Built while the parameters are still fp32 (before `use_bf16_parameters`), so the main parameters
    start from the exact initial values. `param_groups` and `state` are the inner optimizer's.
    """

    def __init__(self, param_groups: list[dict], make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]) -> None:
        self.params: list[nn.Parameter] = [p for group in param_groups for p in group["params"]]
        for param in self.params:
            param.main_param = param.detach().to(torch.float32, copy=True)
        self.inner = make_optimizer([{**group, "params": [p.main_param for p in group["params"]]}
                                     for group in param_groups])

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        return self.inner.state

    @property
    def found_inf(self) -> torch.Tensor | None:
        return getattr(self.inner, "found_inf", None)

    @found_inf.setter
    def found_inf(self, value: torch.Tensor | None) -> None:
        self.inner.found_inf = value

    @torch.no_grad()
    def step(self) -> None:
        for param in self.params:
            param.main_param.grad = grad_buffer(param)
        self.inner.step()
        for param in self.params:
            param.main_param.grad = None
            param.data.copy_(param.main_param)


def checkpoint_values(model: nn.Module, loading: bool) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with each bf16 parameter's value in fp32: its main parameter where this
    rank has one; elsewhere, when `loading`, a fresh fp32 tensor (`set_parameters` copies it in), and
    when saving nothing (the owner rank writes the key). An fp32 model's state dict as it is."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        param = params.get(name)
        if param is None or not has_main_grad(param):
            out[name] = tensor
        elif hasattr(param, "main_param"):
            out[name] = param.main_param
        elif loading:
            out[name] = torch.empty_like(param, dtype=torch.float32)
    return out


@torch.no_grad()
def set_parameters(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """After a load into `checkpoint_values(model, loading=True)`: round the fp32 values into the bf16
    parameters (the main parameters were loaded in place)."""
    for name, param in model.named_parameters(remove_duplicate=False):
        if has_main_grad(param) and name in values:
            param.copy_(values[name])
