"""Split backward: B computes input gradients now, W computes weight gradients later.

Every weight GEMM of the model (MLA projections, dense and shared SwiGLU, routed experts, LM head,
MTP eh_proj) goes through the `GemmOps` the model was built with. A pipeline builds its model with
`SplitGemmOps(store)`, whose autograd Functions below return only the input gradient in backward
and hand the weight-gradient GEMM to `store` as a closure. Whether the closure is queued (B) or run
at once (BW, or a backward outside any scope) is decided when the backward runs, by the store's
`scope(stage, microbatch, mode)`, so one forward serves both kinds of schedule. With
`train.precision=fp8` the model's GEMMs are `model.fp8.Fp8GemmOps` whose weight gradients go to
`SplitGemmOps.defer` (`split_gemms`), the output head keeping these bf16 ones. Norms, embeddings, the router and the MoE balance-loss
injection (`model.moe.AuxLossGradient`) stay in ordinary autograd: their gradients are produced
during B.

A runtime step, for actions keyed by (stage, microbatch), on `DeepSeekV3(..., SplitGemmOps(store))`::

    zero_grad_buffers(model.parameters())           # once per optimizer step
    F:  out = stage_forward(...)
    B:  with store.scope(stage, mb, ActionKind.B):  torch.autograd.backward(out, grad)
    W:  store.run_w(stage, mb)
    BW: with store.scope(stage, mb, ActionKind.BW): torch.autograd.backward(out, grad)
    store.assert_empty()                            # then the optimizer step

Gradient buffers: the weight gradient accumulates through `parallel.mixed_precision.accumulate_grad`,
the one accumulation every backward uses: into the parameter's own fp32 `.grad` in an fp32 model,
into its fp32 `main_grad` when the parameters are bf16. The buffers persist across steps and are
zeroed in place by `zero_grad_buffers` (not set to None), so the data-parallel layer may later make
them views of flat communication buckets.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from model.fp8 import Fp8GemmOps, Fp8Tensor
from model.layers import GemmOps, GroupEnds, gemm_dtype, grouped_mm, grouped_weight_grad
from model.recompute import Recompute
from parallel.mixed_precision import accumulate_grad, accumulate_weight_grad
from parallel.pipeline.ir import BACKWARD_KINDS, ActionKind, ScheduleError

WeightGradWork = Callable[[], None]


@dataclass(frozen=True)
class BackwardScope:
    """The backward that is running: its stage, micro-batch and mode (B defers W, BW does not)."""

    stage: int
    microbatch: int
    mode: ActionKind


class WeightGradStore:
    """One rank's deferred weight-gradient work: one unit of closures per (stage, micro-batch).

    Closures only add into gradient buffers, so W's may run in any order (results differ in
    rounding only); inside a unit the closures run in the order their backward queued them. A B that
    enters the same scope twice (a backward cut into pieces) extends its unit. Outside any scope
    closures run at once, so a plain `loss.backward()` still gives complete gradients.

    The running scope is plain state, not thread-local: on CUDA the autograd engine calls backward
    functions from its own device thread. Hence one backward at a time per store.
    """

    def __init__(self) -> None:
        self._units: dict[tuple[int, int], list[WeightGradWork]] = {}
        self._scope: BackwardScope | None = None

    @property
    def current(self) -> BackwardScope | None:
        return self._scope

    @contextlib.contextmanager
    def scope(self, stage: int, microbatch: int, mode: ActionKind | str) -> Iterator[BackwardScope]:
        """Mark the backward run inside the block as B or BW of (stage, microbatch)."""
        mode = ActionKind(mode)
        if mode not in BACKWARD_KINDS:
            raise ValueError(f"a backward scope is B or BW, got {mode.value}")
        if self._scope is not None:
            raise RuntimeError(f"backward {self._scope} is still running")
        self._scope = BackwardScope(stage, microbatch, mode)
        if mode is ActionKind.B:
            self._units.setdefault((stage, microbatch), [])
        try:
            yield self._scope
        finally:
            self._scope = None

    def put(self, work: WeightGradWork) -> None:
        """Queue `work` under the running B, or run it now (BW, or no backward scope)."""
        scope = self._scope
        if scope is None or scope.mode is ActionKind.BW:
            work()
        else:
            self._units[(scope.stage, scope.microbatch)].append(work)

    def pop(self, stage: int, microbatch: int) -> list[WeightGradWork]:
        """Remove and return the unit of (stage, microbatch), closures in FIFO order."""
        try:
            return self._units.pop((stage, microbatch))
        except KeyError:
            raise ScheduleError(f"W{stage}.{microbatch}: no B{stage}.{microbatch} is waiting for its W") from None

    def run_w(self, stage: int, microbatch: int) -> None:
        for work in self.pop(stage, microbatch):
            work()

    def pending(self) -> list[tuple[int, int]]:
        """(stage, microbatch) of every B whose W has not run, oldest first."""
        return list(self._units)

    def is_empty(self) -> bool:
        return not self._units

    def assert_empty(self) -> None:
        """End-of-step check: every B had its W, so every weight gradient is complete."""
        if self._units:
            missing = ", ".join(f"W{stage}.{mb}" for stage, mb in self._units)
            raise ScheduleError(f"W store is not empty at the end of the step: missing {missing}")


@torch.no_grad()  # W runs outside the backward: the saved operands still require grad, build no graph on them
def _linear_weight_grad(weight: nn.Parameter, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    accumulate_grad(weight, grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))


@torch.no_grad()
def _grouped_weight_grad(weight: nn.Parameter, grad_out: torch.Tensor, x: torch.Tensor,
                         offsets: torch.Tensor) -> None:
    """Adds a gradient for every expert; the slice of an expert that got no tokens is zero."""
    accumulate_grad(weight, grouped_weight_grad(grad_out, x, offsets))


class SplitLinearFunction(torch.autograd.Function):
    """y = x @ W^T. Casts explicitly (autocast does not reach the backward of a custom Function)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter, store: WeightGradStore) -> torch.Tensor:
        dtype = gemm_dtype(x, weight)
        x_c, w_c = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x_c, w_c)
        ctx.weight, ctx.store, ctx.x_dtype = weight, store, x.dtype
        return F.linear(x_c, w_c)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x_c, w_c = ctx.saved_tensors
        grad_out = grad_out.to(w_c.dtype)
        grad_x = (grad_out @ w_c).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            ctx.store.put(partial(_linear_weight_grad, ctx.weight, grad_out, x_c))
        return grad_x, None, None


class SplitGroupedLinearFunction(torch.autograd.Function):
    """y = x_g @ W_g^T per expert group; the grouped weight-gradient GEMM is deferred. Casts as
    `SplitLinearFunction` does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter, offsets: torch.Tensor,
                store: WeightGradStore) -> torch.Tensor:
        dtype = gemm_dtype(x, weight)
        x_c, w_c = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x_c, w_c, offsets)
        ctx.weight, ctx.store, ctx.x_dtype = weight, store, x.dtype
        return grouped_mm(x_c, w_c.transpose(1, 2), offsets)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x_c, w_c, offsets = ctx.saved_tensors
        grad_out = grad_out.to(w_c.dtype).contiguous()
        grad_x = grouped_mm(grad_out, w_c, offsets).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            ctx.store.put(partial(_grouped_weight_grad, ctx.weight, grad_out, x_c, offsets))
        return grad_x, None, None, None


class SplitGemmOps(GemmOps):
    """`GemmOps` whose weight gradients go through `store`."""

    def __init__(self, store: WeightGradStore) -> None:
        self.store = store

    def defer(self, weight: nn.Parameter, compute: Callable[[], torch.Tensor]) -> None:
        """Queue a weight gradient that `compute` returns (model.fp8's FP8 Wgrad) as W work."""
        self.store.put(partial(accumulate_weight_grad, weight, compute))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, recompute: Recompute | None = None) -> torch.Tensor:
        return SplitLinearFunction.apply(x, weight, self.store)

    def grouped(self, x: torch.Tensor, weight: torch.Tensor, groups: GroupEnds,
                x_fp8: Fp8Tensor | None = None) -> torch.Tensor:
        return SplitGroupedLinearFunction.apply(x, weight, groups.offsets, self.store)



def split_gemms(store: WeightGradStore, fp8: bool) -> GemmOps:
    """The GEMMs of a pipeline's model: split B/W, in FP8 (model.fp8, the head in bf16) or not."""
    split = SplitGemmOps(store)
    return Fp8GemmOps(sink=split.defer, high_precision=split) if fp8 else split
