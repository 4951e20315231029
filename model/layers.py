"""The weight-GEMM family (Linear, GroupedLinear), RMSNorm and the SwiGLU MLP.

Every weight GEMM goes through its module's `gemms` (a `GemmOps`); the model hands all of its
modules the one it was built with, so a pipeline builds its stages with split-backward (B/W)
GEMMs (`parallel.pipeline.wgrad.SplitGemmOps`) without touching the modules.
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from model.recompute import Recompute

if TYPE_CHECKING:
    from model.fp8 import Fp8Tensor


class GroupEnds:
    """Where the groups of rows sorted by group end, for the grouped GEMMs of one call: `offsets`, the int32
    cumulative ends [G] on the device, which torch's grouped GEMMs take; `host()`, the same ends on the host,
    for the GEMMs that loop over the groups there (model.fp8 on torch's blockwise kernel). The routed experts'
    GEMMs, forward and backward, share one object, so the ends are read to the host at most once for all of
    them: one synchronisation per MoE layer and micro-batch instead of one per GEMM, none where no GEMM asks,
    and none where the caller knows the rows per group on the host already (an EP dispatcher's counts)."""

    def __init__(self, offsets: torch.Tensor, host_counts: Sequence[int] | None = None) -> None:
        """`host_counts`: the rows per group, on the host, when the caller has them (they must be the
        counts `offsets` accumulates)."""
        if host_counts is not None and len(host_counts) != len(offsets):
            raise ValueError(f"GroupEnds: {len(host_counts)} host counts for {len(offsets)} groups")
        self.offsets = offsets
        self._host = None if host_counts is None else tuple(itertools.accumulate(host_counts))

    @classmethod
    def of_counts(cls, counts: torch.Tensor, host_counts: Sequence[int] | None = None) -> GroupEnds:
        """From the rows per group [G] on the device (and on the host when known)."""
        return cls(torch.cumsum(counts, 0).to(torch.int32), host_counts)

    def host(self) -> tuple[int, ...]:
        if self._host is None:
            self._host = tuple(self.offsets.tolist())
        return self._host

    def __len__(self) -> int:
        return len(self.offsets)


def _group_rows(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """[G, rows] bool: row r belongs to group g (offsets: int32 cumulative ends)."""
    ends = offsets.long().unsqueeze(1)
    starts = torch.cat([ends.new_zeros(1, 1), ends[:-1]])
    row = torch.arange(rows, device=offsets.device)
    return (row >= starts) & (row < ends)


def _grouped_mm_reference(x: torch.Tensor, weight_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x[rows of g] @ weight_t[g], used where `torch._grouped_mm` cannot run. Each group multiplies
    every row and keeps its own (G times the FLOPs) so the group sizes are never read on the host."""
    out = None
    for g, in_group in enumerate(_group_rows(offsets, x.shape[0]).unsqueeze(2)):
        out = torch.where(in_group, x @ weight_t[g], 0 if out is None else out)
    return out


_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fused_ok(*tensors: torch.Tensor) -> bool:
    """`torch._grouped_mm` exists and accepts these operands.

    It takes fp32/bf16/fp16 only, rejects an operand with no rows (a rank whose experts got no
    tokens) and needs strides in 16-byte multiples; the per-group reference handles the rest.
    """
    return hasattr(torch, "_grouped_mm") and all(
        t.dtype in _GROUPED_MM_DTYPES and t.numel() > 0 for t in tensors) and all(
        (stride * t.element_size()) % 16 == 0 for t in tensors for stride in t.stride() if stride != 1)


def grouped_mm(x: torch.Tensor, weight_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [M, K] (rows sorted by group), weight_t [G, K, N], offsets [G] int32 cumulative ends -> [M, N]."""
    if _fused_ok(x, weight_t):
        return torch._grouped_mm(x, weight_t, offs=offsets)
    return _grouped_mm_reference(x, weight_t, offsets)


def grouped_weight_grad(grad_out: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-group grad_out_g^T @ x_g -> [G, N, K] (the gradient of a [G, N, K] weight)."""
    if _fused_ok(grad_out, x):
        return torch._grouped_mm(grad_out.t(), x, offs=offsets)
    masks = _group_rows(offsets, x.shape[0]).unsqueeze(2)  # as the forward fallback: no host read of sizes
    return torch.stack([torch.where(m, grad_out, 0).t() @ torch.where(m, x, 0) for m in masks])


class _GroupedLinearFunction(torch.autograd.Function):
    """y = x_g @ W_g^T per group; backward makes the incoming grad contiguous (grouped_mm needs it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offsets)
        return grouped_mm(x, weight.transpose(1, 2), offsets)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, offsets = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grouped_mm(grad_out, weight, offsets) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = grouped_weight_grad(grad_out, x, offsets).to(weight.dtype)
        return grad_x, grad_w, None


def gemm_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype a weight GEMM computes in: autocast's (which leaves fp64 alone), else the weight's.

    F.linear gets this from autocast itself; the grouped GEMM and the split-backward Functions
    cast explicitly, since autocast neither covers `torch._grouped_mm` nor reaches a backward.
    """
    device = x.device.type
    if torch.is_autocast_enabled(device) and weight.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return weight.dtype


class GemmOps:
    """The two weight-GEMM entry points, plain autograd; subclassed for the pipeline's B/W split and for FP8."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, recompute: Recompute | None = None) -> torch.Tensor:
        """`recompute`: the decoder layer's, for what a GEMM derives from an input its regions rebuild
        (model.fp8's FP8 copies); F.linear saves the input itself, which the regions already cover."""
        return F.linear(x, weight)

    def grouped(self, x: torch.Tensor, weight: torch.Tensor, groups: GroupEnds,
                x_fp8: Fp8Tensor | None = None) -> torch.Tensor:
        """Both operands in `gemm_dtype`: a bf16 weight's (bf16 training) or autocast's, whose cast
        returns the weight gradient in the fp32 of an fp32 weight. `x_fp8`, x as the FP8 dispatch
        delivered it, is for FP8 GEMMs (model.fp8): these ignore it."""
        dtype = gemm_dtype(x, weight)
        return _GroupedLinearFunction.apply(x.to(dtype), weight.to(dtype), groups.offsets)

    def grouped_activated(self, activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                          row_weights: torch.Tensor, weight: torch.Tensor, groups: GroupEnds,
                          recompute: Recompute) -> torch.Tensor:
        """`grouped(activation(x, row_weights), weight, groups)`: the routed experts' down projection of
        their SwiGLU, the activation rebuilt in backward where `recompute` holds `moe_act`."""
        return self.grouped(recompute.region("moe_act", activation, x, row_weights), weight, groups)

    def linear_activated(self, activation: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                         weight: torch.Tensor, recompute: Recompute | None) -> torch.Tensor:
        """`linear(activation(x), weight)`: the shared expert's down projection of its SwiGLU, the
        activation rebuilt in backward where `recompute` holds `moe_act`, as the routed experts'."""
        hidden = activation(x) if recompute is None else recompute.region("moe_act", activation, x)
        return self.linear(hidden, weight, recompute)

    def high_precision(self) -> "GemmOps":
        """The GEMMs for what lower-precision GEMMs leave out (the output head): these themselves."""
        return self

    def at_dispatch_boundary(self, inputs: bool = False, output_grads: bool = False) -> "GemmOps":
        """The GEMMs for the routed experts, whose inputs (and output gradients) cross the dispatch:
        only lower-precision GEMMs quantize them differently (model.fp8). These themselves."""
        return self

    def weights_fixed(self) -> contextlib.AbstractContextManager[None]:
        """A scope in which the weights do not change (one optimizer step's forwards and backwards):
        GEMMs may reuse what they derive from them (model.fp8's FP8 copies). Nothing to reuse here."""
        return contextlib.nullcontext()


class Linear(nn.Module):
    """Bias-free linear layer whose GEMM goes through `gemms` (the model sets its own); a decoder
    layer's Linears get its `recompute` (model.recompute)."""

    def __init__(self, in_features: int, out_features: int, init_std: float = 0.02,
                 recompute: Recompute | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.init_std = in_features, out_features, init_std
        self.recompute = recompute
        self.gemms = GemmOps()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemms.linear(x, self.weight, self.recompute)

    def forward_activated(self, activation: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """This GEMM of `activation(x)` (`GemmOps.linear_activated`), for a decoder layer's Linear."""
        return self.gemms.linear_activated(activation, x, self.weight, self.recompute)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"


class GroupedLinear(nn.Module):
    """One weight [G, out, in] per group (expert); rows of the input arrive sorted by group. Its
    GEMM goes through `gemms` as `Linear`'s does."""

    def __init__(self, num_groups: int, in_features: int, out_features: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.init_std = init_std
        self.gemms = GemmOps()
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)

    def forward(self, x: torch.Tensor, groups: GroupEnds, x_fp8: Fp8Tensor | None = None) -> torch.Tensor:
        """`x_fp8`: the rows x dequantizes from, as the FP8 dispatch moved them (`GemmOps.grouped`)."""
        return self.gemms.grouped(x, self.weight, groups, x_fp8)

    def forward_activated(self, activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                          row_weights: torch.Tensor, groups: GroupEnds, recompute: Recompute) -> torch.Tensor:
        """This GEMM of `activation(x, row_weights)` (`GemmOps.grouped_activated`)."""
        return self.gemms.grouped_activated(activation, x, row_weights, self.weight, groups, recompute)

    def extra_repr(self) -> str:
        return f"groups={self.num_groups}, in={self.in_features}, out={self.out_features}"


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as DeepSeek-V3 and HF do. A decoder layer's norms get
    its `Recompute` (model.recompute), which rebuilds them in backward under `layernorm`."""

    def __init__(self, dim: int, eps: float = 1e-6, recompute: Recompute | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.recompute = recompute
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute is None:
            return self._normalize(x)
        return self.recompute.region("layernorm", self._normalize, x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SwiGLU(nn.Module):
    """Dense SwiGLU FFN: down(silu(gate(x)) * up(x)); also the shared expert."""

    def __init__(self, dim: int, hidden: int, init_std: float, recompute: Recompute | None = None,
                 shared_expert: bool = False) -> None:
        """`shared_expert`: part of a MoE, whose SwiGLU DeepSeek-V3 runs as the routed experts' (§3.3.3):
        the down projection of the packed gate|up output through `Linear.forward_activated`, so that
        the activation is rebuilt in backward under `moe_act` and, with FP8 GEMMs, its input cached
        in FP8. A dense FFN (False) keeps its activation."""
        super().__init__()
        self.shared_expert = shared_expert
        self.gate_proj = Linear(dim, hidden, init_std, recompute)
        self.up_proj = Linear(dim, hidden, init_std, recompute)
        self.down_proj = Linear(hidden, dim, init_std, recompute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if not self.shared_expert:
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj.forward_activated(packed_swiglu, torch.cat((gate, up), dim=-1))


def packed_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the packed gate|up rows (each half of the last dimension)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
