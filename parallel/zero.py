"""The optimizer of a rank's pieces: Megatron's distributed optimizer (ZeRO-1) and its unsharded case.

The optimizer state of each parameter lives with the ranks that own its elements
(parallel.grad_buffers: with ZeRO-1 a bucket is cut evenly over its replica group, dense parameters
over dp, routed experts over expert-dp, copies another pipeline rank holds over that pair x dp;
without it every rank owns everything). This rank's AdamW (built by `make_optimizer`:
parallel.adamw's, fp32 or bf16 moments) steps the fp32 main values of its pieces, whose `.grad` are
views of the reduced fp32 gradients; bf16 parameters then take their pieces' new values, rounded,
and each bucket's parameters are all-gathered. AdamW is element-wise, so every layout computes
what one process computes, up to the order in which the gradients were summed.

Written here rather than reusing `torch.distributed.optim.ZeroRedundancyOptimizer` because our
parameters have several kinds of replica groups and because checkpoints address optimizer state by
parameter name (parallel.sharded_state), so a run can resume with another layout.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from parallel.grad_buffers import ParamBuffers, Piece


class DistributedOptimizer:
    """AdamW over this rank's pieces of `buffers`; `param_groups` are AdamW groups of the model's
    parameters (e.g. with and without weight decay), each piece stepped with its parameter's group."""

    def __init__(self, buffers: ParamBuffers, param_groups: list[dict],
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]) -> None:
        self.buffers = buffers
        group_of = {id(p): index for index, group in enumerate(param_groups) for p in group["params"]}
        mains: list[list[torch.Tensor]] = [[] for _ in param_groups]
        for piece in buffers.pieces:
            piece.main.grad = piece.grad
            mains[group_of[id(piece.param)]].append(piece.main)
        self.inner = make_optimizer([{**group, "params": params} for group, params in zip(param_groups, mains)])
        self._low_precision = [piece for piece in buffers.pieces if piece.param.dtype != torch.float32]

    @property
    def pieces(self) -> list[Piece]:
        return self.buffers.pieces

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        return self.inner.state

    @property
    def found_inf(self) -> torch.Tensor | None:
        """GradScaler's protocol, passed to the inner AdamW: a 1.0 tensor skips the step on the device."""
        return getattr(self.inner, "found_inf", None)

    @found_inf.setter
    def found_inf(self, value: torch.Tensor | None) -> None:
        self.inner.found_inf = value

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        for piece in self._low_precision:
            piece.param.detach().view(-1)[piece.start:piece.stop].copy_(piece.main)
        self.buffers.gather_parameters()

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 main values this rank steps, by parameter name (one piece per parameter)."""
        return {piece.name: piece.main for piece in self.pieces}

