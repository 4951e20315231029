"""Multi-Token Prediction: depth k predicts token i+k+1 from h_i^{k-1} and the embedding of i+k.

Inputs are concatenated as [enorm(embedding) ; hnorm(hidden)], the order every implementation that
loads the released weights uses. The main-model input to depth 1 is the last layer's output
before the final norm.
"""
from __future__ import annotations

import torch
from torch import nn

from model.args import ModelArgs
from model.block import DecoderLayer
from model.dispatcher import Dispatcher
from model.layers import Linear, RMSNorm

IGNORE_INDEX = -100


class MTPLayer(nn.Module):
    def __init__(self, args: ModelArgs, dispatcher: Dispatcher | None = None) -> None:
        super().__init__()
        d = args.hidden_size
        self.enorm = RMSNorm(d, args.norm_epsilon)
        self.hnorm = RMSNorm(d, args.norm_epsilon)
        self.eh_proj = Linear(2 * d, d, args.init_method_std)
        self.block = DecoderLayer(args, moe=args.num_moe_experts > 0, dispatcher=dispatcher)
        self.final_norm = RMSNorm(d, args.norm_epsilon)

    def forward(self, hidden: torch.Tensor, next_embedding: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, aux_grad_scale: float | None = None) -> torch.Tensor:
        """Returns h^k (pre-norm); logits are head(final_norm(h^k))."""
        merged = torch.cat((self.enorm(next_embedding), self.hnorm(hidden)), dim=-1)
        return self.block(self.eh_proj(merged), cos, sin, aux_grad_scale=aux_grad_scale)


def shift_left(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """x[:, t + k] at position t; the last k positions get `fill`."""
    shifted = torch.roll(x, shifts=-k, dims=1)
    shifted[:, -k:] = fill
    return shifted
